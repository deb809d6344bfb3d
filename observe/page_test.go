package observe_test

import (
	"bytes"
	"context"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/uproxy/uproxy/proxier"
	"github.com/uproxy/uproxy/service"
	"github.com/uproxy/uproxy/test/testbed"
)

// runChromium runs headless Chromium on url with extra flags (the action: dump
// the DOM, take a screenshot) and returns its standard output. The virtual time
// budget lets the page's polling run and render before the action.
func runChromium(t *testing.T, bin, url string, flags ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	args := append([]string{
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
		"--disable-component-update", "--disable-sync", "--no-first-run",
		"--disable-dev-shm-usage", "--hide-scrollbars", "--force-color-profile=srgb",
		"--user-data-dir=" + t.TempDir(), "--virtual-time-budget=3000",
	}, flags...)
	args = append(args, url)
	cmd := exec.CommandContext(ctx, bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("chromium %s: %v\n%s", strings.Join(flags, " "), err, stderr.Bytes())
	}
	return stdout.Bytes()
}

// The live page, loaded in a real browser against a running proxy that has
// retried and ejected: it must show the Services, their endpoints with the
// ejected one marked, and the timeline of connections with their attempts.
func TestPageInChromium(t *testing.T) {
	bin := testbed.BrowserPath(t)
	// A long ejection keeps the endpoint ejected while the browser starts.
	w := mkWorld(t, proxier.Config{EjectAfter: 2, EjectBase: time.Hour})
	live := echoBackend(t, "127.0.0.2")
	flaky := refusedAddr(t, "127.0.0.3")
	svc, pp := w.addService(service.TCP, false, live, flaky)
	udpSvc, _ := w.addService(service.UDP, false, udpEcho(t, "127.0.0.4"))
	for i := range 4 {
		if _, err := echoThrough(t, pp, "hello"); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
	}
	if st := w.endpointState(svc, flaky); !st.Ejected {
		t.Fatalf("setup: %s not ejected: %+v", flaky, st)
	}
	conflicts := service.Build(conflictingServices(), nil, service.BuildOptions{})
	// One of them with a Service port the page shows, which notes it.
	conflicts.Conflicts = append(conflicts.Conflicts, &service.Conflict{
		Claim:    service.Claim{Addr: netip.MustParseAddr("10.96.0.10"), Port: 80, Protocol: service.TCP},
		ServedBy: w.ports[0].Name, LeftOut: service.PortName{Namespace: "t", Name: "copy", Port: "p"}})
	w.conflicts.Update(conflicts)
	url := w.srv.URL + "/debug/"

	t.Run("DOM", func(t *testing.T) {
		dom := string(runChromium(t, bin, url, "--dump-dom"))
		for _, want := range []string{
			`<b id="mode">userspace</b>`,
			fmt.Sprintf(`data-service="%s"`, svc),
			fmt.Sprintf(`data-service="%s"`, udpSvc),
			fmt.Sprintf(`<tr class="endpoint" data-endpoint="%s">`, live),
			fmt.Sprintf(`<tr class="endpoint ejected" data-endpoint="%s">`, flaky),
			"ejected until",
			`data-outcome="success"`,
			`data-outcome="retried"`,
			`data-kind="ejection"`,
			flaky.String() + " refused",
			live.String() + " success",
			`<div id="conflicts">`, // shown: there are conflicts
			`<tr class="conflict" data-address="10.96.0.10:80/TCP"><td class="mono">10.96.0.10:80/TCP</td><td class="mono">c/a:http</td><td class="mono bad">c/b:http</td></tr>`,
			`data-address="nodePort 30080/TCP"`,
			"10.96.0.10:80/TCP also claimed by t/copy:p (left out)",
		} {
			if !strings.Contains(dom, want) {
				t.Errorf("DOM: missing %s", want)
			}
		}
		if t.Failed() {
			t.Logf("DOM:\n%s", dom)
		}
	})

	t.Run("screenshot", func(t *testing.T) {
		dir := os.Getenv("UPROXY_ARTIFACTS")
		if dir == "" {
			dir = t.TempDir()
		}
		file := filepath.Join(dir, "debug-page.png")
		runChromium(t, bin, url, "--screenshot="+file, "--window-size=1280,1000")
		f, err := os.Open(file)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		img, err := png.Decode(f)
		if err != nil {
			t.Fatalf("screenshot %s: %v", file, err)
		}
		if b := img.Bounds(); b.Dx() != 1280 || b.Dy() != 1000 {
			t.Errorf("screenshot size: got %dx%d, want 1280x1000", b.Dx(), b.Dy())
		}
		// The page's colours say what happened: the ejected endpoint's row,
		// failed attempts and successful attempts each have their own.
		for _, c := range []struct {
			what string
			rgb  color.RGBA
		}{
			{"ejected endpoint row / failed attempt (#ffebe9)", color.RGBA{0xff, 0xeb, 0xe9, 0xff}},
			{"successful attempt (#dafbe1)", color.RGBA{0xda, 0xfb, 0xe1, 0xff}},
		} {
			if n := countColor(img, c.rgb); n < 200 {
				t.Errorf("screenshot %s: %d pixels of %s, want at least 200", file, n, c.what)
			}
		}
		t.Logf("screenshot: %s", file)
	})
}

// countColor counts the pixels of img within a small distance of want
// (anti-aliasing at glyph edges shifts a few values).
func countColor(img image.Image, want color.RGBA) int {
	near := func(a uint32, b uint8) bool {
		d := int(a>>8) - int(b)
		return d >= -2 && d <= 2
	}
	n := 0
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, bl, _ := img.At(x, y).RGBA()
			if near(r, want.R) && near(g, want.G) && near(bl, want.B) {
				n++
			}
		}
	}
	return n
}
