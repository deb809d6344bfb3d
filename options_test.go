package main

import (
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
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
		{[]string{"--tcp-keepalive=-1s"}, "--tcp-keepalive"},
		{[]string{"--tcp-keepalive=500ms"}, "--tcp-keepalive"},
		{[]string{"--tcp-keepalive=10h"}, "--tcp-keepalive"},
		{[]string{"--tcp-idle-timeout=-1s"}, "--tcp-idle-timeout"},
		{[]string{"--bind-address=not-an-ip"}, "--bind-address"},
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

// --tcp-keepalive and --tcp-idle-timeout reach the proxier's Config, whose zero
// keepalive is the default: the flag's 0 (off) becomes a negative one.
func TestTCPLivenessFlags(t *testing.T) {
	tests := []struct {
		args                    []string
		wantKeepAlive, wantIdle time.Duration
	}{
		{nil, 15 * time.Second, 0},
		{[]string{"--tcp-keepalive=0"}, -1, 0},
		{[]string{"--tcp-keepalive=1m", "--tcp-idle-timeout=1h"}, time.Minute, time.Hour},
	}
	for _, tt := range tests {
		o := defaultOptions()
		cmd := &cobra.Command{Use: "uproxy"}
		o.addFlags(cmd)
		if err := cmd.Flags().Parse(tt.args); err != nil {
			t.Fatal(err)
		}
		c, err := o.validate()
		if err != nil {
			t.Fatalf("validate with %v: %v", tt.args, err)
		}
		if c.proxier.TCPKeepAlive != tt.wantKeepAlive || c.proxier.TCPIdleTimeout != tt.wantIdle {
			t.Errorf("validate with %v: got keepalive %v, idle timeout %v; want %v, %v",
				tt.args, c.proxier.TCPKeepAlive, c.proxier.TCPIdleTimeout, tt.wantKeepAlive, tt.wantIdle)
		}
	}
}
