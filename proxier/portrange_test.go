package proxier

import "testing"

func TestParsePortRange(t *testing.T) {
	tests := []struct {
		in      string
		want    PortRange
		wantErr bool
	}{
		{"", PortRange{}, false},
		{"30000-30010", PortRange{30000, 30010}, false},
		{"30000+10", PortRange{30000, 30010}, false},
		{" 1-65535 ", PortRange{1, 65535}, false},
		{"5-5", PortRange{5, 5}, false},
		{"30010-30000", PortRange{}, true},
		{"0-10", PortRange{}, true},
		{"1-65536", PortRange{}, true},
		{"65535+1", PortRange{}, true},
		{"abc", PortRange{}, true},
		{"-5", PortRange{}, true},
		{"10-x", PortRange{}, true},
		{"10+-1", PortRange{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParsePortRange(tt.in)
			if (err != nil) != tt.wantErr {
				t.Fatalf("ParsePortRange(%q) error = %v, want error %v", tt.in, err, tt.wantErr)
			}
			if got != tt.want {
				t.Errorf("ParsePortRange(%q) = %+v, want %+v", tt.in, got, tt.want)
			}
		})
	}
}

func FuzzParsePortRange(f *testing.F) {
	for _, s := range []string{"", "1-2", "30000+100", "x", "-", "+", "65535-1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParsePortRange(s)
		if err != nil {
			return
		}
		if r.First != 0 && (r.First < 1 || r.Last > 65535 || r.Last < r.First) {
			t.Fatalf("ParsePortRange(%q) = %+v: accepted an invalid range", s, r)
		}
	})
}
