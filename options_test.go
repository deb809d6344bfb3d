package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"
)

// Each bad flag value is refused at start with an error naming the flag.
func TestValidateNamesTheBadFlag(t *testing.T) {
	tests := []struct {
		args     []string
		wantFlag string
	}{
		{[]string{"--event-loops=-1"}, "--event-loops"},
		{[]string{"--event-loops=100000"}, "--event-loops"},
		{[]string{"--eject-after=-2"}, "--eject-after"},
		{[]string{"--dial-mark-bit=32"}, "--dial-mark-bit"},
		{[]string{"--dial-mark-bit=-2"}, "--dial-mark-bit"},
		{[]string{"--dial-timeouts=1s,,2s"}, "--dial-timeouts"},
		{[]string{"--udp-timeout=0s"}, "--udp-timeout"},
		{[]string{"--bind-address=not-an-ip"}, "--bind-address"},
		{[]string{"--events=-5"}, "--events"},
		{[]string{"--dial-mark-bit=14"}, "--dial-mark-bit"},
		{[]string{"--dial-mark-bit=15"}, "--dial-mark-bit"},
		{[]string{"--metrics-bind-address=127.0.0.1:99999"}, "--metrics-bind-address"},
		{[]string{"--metrics-bind-address=127.0.0.1:http"}, "--metrics-bind-address"},
		{[]string{"--healthz-bind-address=0.0.0.0:-1"}, "--healthz-bind-address"},
		{[]string{"--proxy-mode=nope"}, "--proxy-mode"},
		{[]string{"--proxy-mode=userspace", "--scheduler=wrr"}, "--scheduler"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			o := defaultOptions()
			cmd := &cobra.Command{Use: "uproxy"}
			o.addFlags(cmd)
			if err := cmd.Flags().Parse(tt.args); err != nil {
				t.Fatalf("parse %v: %v", tt.args, err)
			}
			_, err := o.validate()
			if err == nil || !strings.HasPrefix(err.Error(), tt.wantFlag) {
				t.Errorf("validate with %v: got %v, want an error starting with %q", tt.args, err, tt.wantFlag)
			}
		})
	}
	o := defaultOptions()
	cmd := &cobra.Command{Use: "uproxy"}
	o.addFlags(cmd)
	if err := cmd.Flags().Parse([]string{"--event-loops=3"}); err != nil {
		t.Fatal(err)
	}
	c, err := o.validate()
	if err != nil || c.eventLoops != 3 {
		t.Errorf("validate with --event-loops=3: got %v, %v; want 3 event loops", c, err)
	}
	for bit, want := range map[string]uint32{"13": 0x2000, "0": 1, "31": 0x80000000, "-1": 0} {
		o := defaultOptions()
		cmd := &cobra.Command{Use: "uproxy"}
		o.addFlags(cmd)
		if err := cmd.Flags().Parse([]string{"--dial-mark-bit=" + bit}); err != nil {
			t.Fatal(err)
		}
		if c, err := o.validate(); err != nil || c.dialMark != want {
			t.Errorf("validate with --dial-mark-bit=%s: got %+v, %v; want dial mark %#x", bit, c, err, want)
		}
	}
}

// A taken --metrics-bind-address or --healthz-bind-address port fails the start
// with the flag's name, before anything is logged or touched.
func TestTakenHTTPPortNamesItsFlagFirst(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	var logged bytes.Buffer
	klog.LogToStderr(false)
	klog.SetOutput(&logged)
	defer func() {
		klog.SetOutput(os.Stderr)
		klog.LogToStderr(true)
	}()
	for _, flag := range []string{"--metrics-bind-address", "--healthz-bind-address"} {
		t.Run(flag, func(t *testing.T) {
			logged.Reset()
			o := defaultOptions()
			cmd := &cobra.Command{Use: "uproxy"}
			o.addFlags(cmd)
			args := []string{"--services", t.TempDir(), "--rules", "none",
				"--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "127.0.0.1:0",
				flag, taken.Addr().String()}
			if err := cmd.Flags().Parse(args); err != nil {
				t.Fatal(err)
			}
			err := runProxy(context.Background(), o, nil)
			if err == nil || !strings.HasPrefix(err.Error(), flag+" ") || !strings.Contains(err.Error(), "address already in use") {
				t.Errorf("runProxy with %s taken: got %v, want an error starting with %s and saying the address is in use", flag, err, flag)
			}
			klog.Flush()
			if logged.Len() != 0 {
				t.Errorf("log before the flag error: got %q, want nothing", logged.String())
			}
		})
	}
}

func TestVersionFlag(t *testing.T) {
	for _, args := range [][]string{{"--version"}, {"version"}} {
		root := newRootCommand()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetArgs(args)
		if err := root.Execute(); err != nil {
			t.Fatalf("uproxy %v: %v", args, err)
		}
		if got, want := out.String(), "uproxy "+version+"\n"; got != want {
			t.Errorf("uproxy %v: got %q, want %q", args, got, want)
		}
	}
}
