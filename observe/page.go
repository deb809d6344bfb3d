package observe

import (
	_ "embed"
	"net/http"
)

// page is the live view at /debug/: one self-contained file (no assets from
// elsewhere, so it works on an air-gapped node) that polls /debug/services and
// /debug/events once a second.
//
//go:embed page.html
var page []byte

func servePage(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	// The page fetches only from its own origin; say so, so a hostile manifest
	// value could not make it load anything else even if it slipped into markup.
	w.Header().Set("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'")
	w.Write(page)
}
