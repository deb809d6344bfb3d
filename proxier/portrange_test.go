package proxier

import (
	"slices"
	"testing"

	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

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

func TestParsePortSet(t *testing.T) {
	tests := []struct {
		in       string
		none     bool  // no set at all
		has, not []int // ports in the set, ports out of it
		wantErr  bool
	}{
		{in: "", none: true},
		{in: "\n", none: true},
		{in: "8080\n", has: []int{8080}, not: []int{8079, 8081}},
		{in: "18080-18095,19080-19095\n", has: []int{18080, 18087, 18095, 19080, 19095}, not: []int{18079, 18096, 19079, 19096}},
		{in: "0,65535", has: []int{0, 65535}, not: []int{1, 65534}},
		{in: "9000-9000", has: []int{9000}, not: []int{8999, 9001}},
		{in: "x", wantErr: true},
		{in: "9010-9000", wantErr: true},
		{in: "9000-", wantErr: true},
		{in: "65536", wantErr: true},
		{in: "8080,,8081", wantErr: true},
	}
	for _, tt := range tests {
		s, err := parsePortSet(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("parsePortSet(%q) error = %v, want error %v", tt.in, err, tt.wantErr)
			continue
		}
		if err != nil {
			continue
		}
		if (s == nil) != tt.none {
			t.Errorf("parsePortSet(%q) = %v, want no set %v", tt.in, s != nil, tt.none)
		}
		for _, p := range tt.has {
			if !s.contains(p) {
				t.Errorf("parsePortSet(%q) lacks %d", tt.in, p)
			}
		}
		for _, p := range tt.not {
			if s.contains(p) {
				t.Errorf("parsePortSet(%q) holds %d", tt.in, p)
			}
		}
	}
}

// Without --proxy-port-range the allocator picks from the node's ephemeral
// range as the kernel would, so it leaves out the ports the node reserves
// (net.ipv4.ip_local_reserved_ports) for programs that bind them by number; a
// range the operator gives is used whole. Read from a real network namespace's
// sysctls.
func TestAllocatorSkipsReservedPorts(t *testing.T) {
	testbed.Needs(t, testbed.Netns)
	tp := testbed.New(t)
	tp.MustExec(t, testbed.Node, "sysctl", "-q", "-w", "net.ipv4.ip_local_port_range=40000 40009")
	tp.MustExec(t, testbed.Node, "sysctl", "-q", "-w", "net.ipv4.ip_local_reserved_ports=40000-40003,40005,40008")
	drain := func(r PortRange) []int {
		var a *allocator
		if err := tp.Run(testbed.Node, func() error { a = newAllocator(r); return nil }); err != nil {
			t.Fatal(err)
		}
		var got []int
		for a.each(service.TCP, func(p int) (bool, bool) { got = append(got, p); return true, false }) {
		}
		slices.Sort(got)
		return got
	}
	if got, want := drain(PortRange{}), []int{40004, 40006, 40007, 40009}; !slices.Equal(got, want) {
		t.Errorf("the ephemeral range 40000-40009 with 40000-40003,40005,40008 reserved gave ports %v, want %v", got, want)
	}
	explicit := PortRange{First: 40000, Last: 40009}
	if got := drain(explicit); len(got) != 10 {
		t.Errorf("--proxy-port-range %s gave ports %v, want all ten", explicit, got)
	}
}
