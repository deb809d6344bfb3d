// Package proxyconfig reads a kube-proxy configuration file
// (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1) and maps the part of
// it that uproxy understands onto uproxy's command-line flags, so that a node's
// existing kube-proxy configuration, kubeadm's included, can be reused as it is.
//
//	settings, ignored, err := proxyconfig.Load("/var/lib/uproxy/config.conf")
//	for _, s := range settings {
//		flags.Set(s.Flag, s.Value) // s.Default: the flag's own default
//	}
//
// Every field that maps to a flag yields a Setting, whether the file sets it or
// not: a field left out, null or zero ("", 0, "0s") means what it means to
// kube-proxy v1.36, its default (kubeadm writes every field, most of them zero).
// The exceptions are kube-proxy's pointer fields (conntrack.maxPerCore, .min,
// .tcpEstablishedTimeout, .tcpCloseWaitTimeout): only left out or null is the
// default there, and a zero is the value 0 (leave that sysctl as it is).
// This is kube-proxy's precedence too: with --config, the file decides these
// settings and the matching command-line flags are ignored; see the caller for
// the exceptions.
//
// Fields that kube-proxy knows and uproxy has no use for (masquerade bits,
// feature gates, ...) are accepted and reported as ignored when they hold a
// value; any other field is an error that names it.
package proxyconfig

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"time"

	yamlv2 "go.yaml.in/yaml/v2"
	"sigs.k8s.io/yaml"

	"github.com/uproxy/uproxy/regularfile"
)

// The only configuration type and version read.
const (
	APIVersion = "kubeproxy.config.k8s.io/v1alpha1"
	Kind       = "KubeProxyConfiguration"
)

// Setting is one value of the file, spelled as the flag it maps to would take it.
type Setting struct {
	Field string // path in the file, e.g. "ipvs.scheduler"
	Flag  string // flag name without dashes, e.g. "scheduler"
	Value string
	// Default says the file leaves the field zero and kube-proxy's meaning of
	// that is the program's own default (mode: kube-proxy's default mode,
	// uproxy's; ipvs.scheduler: rr in both): the flag takes its default value
	// and Value is empty.
	Default bool
	// Defaulted says the file leaves the field out, null or zero (out or null
	// for a pointer field): Value is what kube-proxy makes of that, its
	// default, rather than a value the file asks for.
	Defaulted bool
}

func (s Setting) String() string {
	if s.Default {
		return fmt.Sprintf("%s -> --%s (default)", s.Field, s.Flag)
	}
	return fmt.Sprintf("%s -> --%s=%s", s.Field, s.Flag, s.Value)
}

// kind says how a field's value is read.
type kind int

const (
	ignored  kind = iota // known to kube-proxy, unused here: any value
	str                  // a string
	duration             // a Go duration string ("30s"), as metav1.Duration
	number               // a JSON number
	strList              // a list of strings, joined with commas
	boolean              // true or false
)

type field struct {
	kind kind
	flag string
	// section, for the per-mode settings, is the mode whose section the field
	// belongs to; it applies only when that mode, or alsoFor, is the file's mode.
	section string
	// alsoFor is another mode the field applies to: kube-proxy's IPVS mode takes
	// masqueradeAll from the iptables section.
	alsoFor string
	// zero is the value, in the flag's syntax, that kube-proxy v1.36 gives the
	// field when it is absent or zero (its defaulting of v1alpha1); empty: the
	// zero value stands (keepZero) or means the program's default (Setting.Default).
	zero string
	// pointer marks a field kube-proxy's type holds as a pointer: only when it
	// is absent or null does zero apply; a zero in the file is a value.
	pointer bool
	// keepZero: the empty string or list is a value of its own (kubeconfig "":
	// in-cluster).
	keepZero bool
	// port marks the bind addresses: an address without a port gets this
	// one, and the zero address is kube-proxy's default host for the family
	// of bindAddress (wildcard for healthz, loopback for metrics) with it.
	port     int
	loopback bool
}

// schema is KubeProxyConfiguration v1alpha1: every field, with the flag it maps
// to. A nested map is an object whose fields are listed; a field of kind ignored
// accepts anything beneath it.
var schema = map[string]any{
	"apiVersion": field{kind: str},
	"kind":       field{kind: str},
	"clientConnection": map[string]any{
		"kubeconfig":         field{kind: str, flag: "kubeconfig", keepZero: true}, // "": in-cluster
		"qps":                field{kind: number, flag: "kube-api-qps", zero: "5"},
		"burst":              field{kind: number, flag: "kube-api-burst", zero: "10"},
		"contentType":        field{kind: str, flag: "kube-api-content-type", zero: "application/vnd.kubernetes.protobuf"},
		"acceptContentTypes": field{kind: ignored},
	},
	"hostnameOverride":   field{kind: str, flag: "hostname-override", keepZero: true}, // "": the hostname
	"bindAddress":        field{kind: str, flag: "bind-address", zero: "0.0.0.0"},
	"healthzBindAddress": field{kind: str, flag: "healthz-bind-address", port: 10256},
	"metricsBindAddress": field{kind: str, flag: "metrics-bind-address", port: 10249, loopback: true},
	"mode":               field{kind: str, flag: "proxy-mode"},
	"nodePortAddresses":  field{kind: strList, flag: "nodeport-addresses", keepZero: true}, // none: every address (primary in the nftables mode); or [primary]
	"configSyncPeriod":   field{kind: duration, flag: "config-sync-period", zero: "15m0s"},
	// portRange and udpIdleTimeout configured kube-proxy's own userspace mode,
	// whose proxy ports and UDP idle timeout uproxy's flags are. kube-proxy
	// v1.36 no longer has udpIdleTimeout; uproxy still reads it.
	"portRange":      field{kind: str, flag: "proxy-port-range", keepZero: true}, // "": the ephemeral range
	"udpIdleTimeout": field{kind: duration, flag: "udp-timeout"},
	"iptables": map[string]any{
		"syncPeriod":    field{kind: duration, flag: "sync-period", section: "iptables", zero: "30s"},
		"minSyncPeriod": field{kind: duration, flag: "min-sync-period", section: "iptables", zero: "1s"},
		"masqueradeBit": field{kind: ignored},
		"masqueradeAll": field{kind: boolean, flag: "masquerade-all", section: "iptables", alsoFor: "ipvs", zero: "false"},
		// A *bool in kube-proxy: left out or null is true, false is false.
		"localhostNodePorts": field{kind: boolean, flag: "iptables-localhost-nodeports", section: "iptables", zero: "true", pointer: true},
	},
	"ipvs": map[string]any{
		"syncPeriod":    field{kind: duration, flag: "sync-period", section: "ipvs", zero: "30s"},
		"minSyncPeriod": field{kind: duration, flag: "min-sync-period", section: "ipvs", zero: "0s"}, // no minimum
		// uproxy's schedulers are IPVS's, by the same names; "" is rr to both.
		"scheduler":     field{kind: str, flag: "scheduler"},
		"excludeCIDRs":  field{kind: ignored},
		"strictARP":     field{kind: ignored},
		"tcpTimeout":    field{kind: ignored},
		"tcpFinTimeout": field{kind: ignored},
		"udpTimeout":    field{kind: ignored},
	},
	"nftables": map[string]any{
		"syncPeriod":    field{kind: duration, flag: "sync-period", section: "nftables", zero: "30s"},
		"minSyncPeriod": field{kind: duration, flag: "min-sync-period", section: "nftables", zero: "1s"},
		"masqueradeBit": field{kind: ignored},
		"masqueradeAll": field{kind: boolean, flag: "masquerade-all", section: "nftables", zero: "false"},
	},
	// The conntrack sysctls, set at start; 0 (false) leaves one as it is.
	"conntrack": map[string]any{
		"maxPerCore":            field{kind: number, flag: "conntrack-max-per-core", zero: "32768", pointer: true},
		"min":                   field{kind: number, flag: "conntrack-min", zero: "131072", pointer: true},
		"tcpEstablishedTimeout": field{kind: duration, flag: "conntrack-tcp-timeout-established", zero: "24h0m0s", pointer: true},
		"tcpCloseWaitTimeout":   field{kind: duration, flag: "conntrack-tcp-timeout-close-wait", zero: "1h0m0s", pointer: true},
		"tcpBeLiberal":          field{kind: boolean, flag: "conntrack-tcp-be-liberal", zero: "false"},
		"udpTimeout":            field{kind: duration, flag: "conntrack-udp-timeout", zero: "0s"},
		"udpStreamTimeout":      field{kind: duration, flag: "conntrack-udp-timeout-stream", zero: "0s"},
	},
	"detectLocal": map[string]any{
		"bridgeInterface":     field{kind: ignored},
		"interfaceNamePrefix": field{kind: ignored},
	},
	"featureGates":                field{kind: ignored},
	"logging":                     field{kind: ignored},
	"bindAddressHardFail":         field{kind: ignored},
	"enableProfiling":             field{kind: boolean, flag: "profiling", zero: "false"},
	"showHiddenMetricsForVersion": field{kind: ignored},
	"winkernel":                   field{kind: ignored},
	"detectLocalMode":             field{kind: ignored},
	// "" is no cluster CIDR; one per family, comma-separated, as the flag.
	"clusterCIDR":         field{kind: str, flag: "cluster-cidr", keepZero: true},
	"oomScoreAdj":         field{kind: ignored},
	"windowsRunAsService": field{kind: ignored},
}

// MaxFileSize bounds what Load reads: 4 MiB, a thousand times kubeadm's
// configuration. A larger file, or a link to an endless one such as
// /dev/zero, is refused rather than read into memory.
const MaxFileSize = 4 << 20

// Load reads the configuration file at path; see Parse. path must be a
// regular file of at most MaxFileSize bytes. Every error begins with path,
// and names it only there.
func Load(path string) (settings []Setting, ignoredFields []string, err error) {
	data, err := regularfile.Read(path, MaxFileSize, "configuration file")
	if err != nil {
		// The system's errors name the file after their operation ("stat
		// PATH: no such file or directory"); only what went wrong is kept.
		if pe, ok := errors.AsType[*fs.PathError](err); ok {
			err = pe.Err
		}
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	settings, ignoredFields, err = Parse(data)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", path, err)
	}
	return settings, ignoredFields, nil
}

// Parse reads a KubeProxyConfiguration in YAML or JSON, the one document of
// data (a trailing empty one aside). It returns a setting
// for every field that maps to a flag, ordered by field path, with
// kube-proxy's default for a field left out or zero, and the fields that hold
// a value uproxy does not use. Unknown fields, duplicate keys, values of the
// wrong type and any other apiVersion or kind are errors naming the field.
//
// The sync periods are taken from the section of the file's mode (iptables when
// the mode is empty, "userspace" or "iptables"), as kube-proxy does; the other
// sections' periods are ignored.
func Parse(data []byte) (settings []Setting, ignoredFields []string, err error) {
	if err := oneDocument(data); err != nil {
		return nil, nil, err
	}
	js, err := yaml.YAMLToJSONStrict(data)
	if err != nil {
		return nil, nil, fmt.Errorf("parse: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.UseNumber()
	var doc map[string]any
	if err := dec.Decode(&doc); err != nil {
		return nil, nil, fmt.Errorf("parse: want one object: %w", err)
	}
	if doc["apiVersion"] != APIVersion || doc["kind"] != Kind {
		return nil, nil, fmt.Errorf("apiVersion %v, kind %v: want %s, %s", doc["apiVersion"], doc["kind"], APIVersion, Kind)
	}
	mode, _ := doc["mode"].(string)
	section := "iptables"
	switch mode {
	case "", "userspace", "iptables":
	case "ipvs", "nftables":
		section = mode
	}

	w := walker{section: section, values: map[string]string{}}
	if err := w.object("", doc, schema); err != nil {
		return nil, nil, err
	}
	settings, err = w.resolve()
	if err != nil {
		return nil, nil, err
	}
	return settings, w.ignored, nil
}

// oneDocument refuses YAML of more than one document: the YAML reader of
// Parse takes the first one only, and a second KubeProxyConfiguration, or
// text that is not YAML at all, would be ignored without a word. A document
// that holds nothing (after a trailing "---", or of comments alone) is
// none. The first document's own errors are left to Parse, which reads it
// strictly.
func oneDocument(data []byte) error {
	const one = "the file must hold one KubeProxyConfiguration"
	dec := yamlv2.NewDecoder(bytes.NewReader(data))
	for n := 1; ; n++ {
		var doc any
		err := dec.Decode(&doc)
		switch {
		case err == io.EOF:
			return nil
		case n == 1 && err != nil:
			return nil
		case n > 1 && err != nil:
			// Not the parser's error: its line numbers are not always the
			// file's.
			return fmt.Errorf("more than one YAML document (document %d does not parse as YAML): %s", n, one)
		case n > 1 && doc != nil:
			return fmt.Errorf("more than one YAML document: %s", one)
		}
	}
}

// appliesTo reports whether the field counts when the file's mode section is
// section.
func (f field) appliesTo(section string) bool {
	return f.section == "" || f.section == section || f.alsoFor == section
}

type walker struct {
	section string
	// values holds the mapped fields the file sets, by path, in the flag's
	// syntax; a zero value is stored as "".
	values  map[string]string
	ignored []string
}

func (w *walker) object(prefix string, obj map[string]any, fields map[string]any) error {
	keys := make([]string, 0, len(obj))
	for k := range obj {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		path := prefix + k
		v := obj[k]
		switch f := fields[k].(type) {
		case nil:
			return fmt.Errorf("unknown field %q", path)
		case map[string]any:
			if v == nil {
				continue
			}
			sub, ok := v.(map[string]any)
			if !ok {
				return fmt.Errorf("field %q: want an object, got %s", path, jsonType(v))
			}
			if err := w.object(path+".", sub, f); err != nil {
				return err
			}
		case field:
			if err := w.leaf(path, v, f); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *walker) leaf(path string, v any, f field) error {
	if f.kind == ignored || !f.appliesTo(w.section) {
		if !isZero(v) {
			w.ignored = append(w.ignored, path)
		}
		return nil
	}
	if f.flag == "" || v == nil {
		return nil // apiVersion and kind, checked by Parse; null means unset
	}
	var value string
	switch f.kind {
	case str:
		s, ok := v.(string)
		if !ok {
			return fmt.Errorf("field %q: want a string, got %s", path, jsonType(v))
		}
		value = s
	case duration:
		s, ok := v.(string)
		if !ok {
			return fmt.Errorf("field %q: want a duration such as \"30s\", got %s", path, jsonType(v))
		}
		d, err := time.ParseDuration(s)
		if err != nil {
			return fmt.Errorf("field %q: %w", path, err)
		}
		if d != 0 || f.pointer {
			value = d.String()
		}
	case number:
		n, ok := v.(json.Number)
		if !ok {
			return fmt.Errorf("field %q: want a number, got %s", path, jsonType(v))
		}
		if z, err := n.Float64(); err != nil || z != 0 || f.pointer {
			value = n.String()
		}
	case strList:
		list, ok := v.([]any)
		if !ok {
			return fmt.Errorf("field %q: want a list of strings, got %s", path, jsonType(v))
		}
		items := make([]string, 0, len(list))
		for i, item := range list {
			s, ok := item.(string)
			if !ok {
				return fmt.Errorf("field %q[%d]: want a string, got %s", path, i, jsonType(item))
			}
			items = append(items, s)
		}
		value = strings.Join(items, ",")
	case boolean:
		b, ok := v.(bool)
		if !ok {
			return fmt.Errorf("field %q: want true or false, got %s", path, jsonType(v))
		}
		if b {
			value = "true"
		} else if f.pointer {
			value = "false"
		}
	}
	w.values[path] = value
	return nil
}

// resolve makes a Setting of every mapped field of the schema (of the mode's
// section), giving the fields the file leaves out or zero kube-proxy's values.
func (w *walker) resolve() ([]Setting, error) {
	var settings []Setting
	var visit func(prefix string, fields map[string]any) error
	visit = func(prefix string, fields map[string]any) error {
		for name, f := range fields {
			path := prefix + name
			switch f := f.(type) {
			case map[string]any:
				if err := visit(path+".", f); err != nil {
					return err
				}
			case field:
				if f.flag == "" || f.kind == ignored || !f.appliesTo(w.section) {
					continue
				}
				st, err := w.setting(path, f)
				if err != nil {
					return err
				}
				settings = append(settings, st)
			}
		}
		return nil
	}
	if err := visit("", schema); err != nil {
		return nil, err
	}
	slices.SortFunc(settings, func(a, b Setting) int { return strings.Compare(a.Field, b.Field) })
	return settings, nil
}

func (w *walker) setting(path string, f field) (Setting, error) {
	st := Setting{Field: path, Flag: f.flag, Value: w.values[path], Defaulted: w.values[path] == ""}
	switch {
	case f.port != 0:
		// kube-proxy's bind addresses: the default host follows bindAddress's
		// family, and a bare IP gets the port.
		if st.Value == "" {
			host := "0.0.0.0"
			if f.loopback {
				host = "127.0.0.1"
			}
			if bind := w.values["bindAddress"]; bind != "" && !isIPv4(bind) {
				host = "::"
				if f.loopback {
					host = "::1"
				}
			}
			st.Value = net.JoinHostPort(host, strconv.Itoa(f.port))
		} else if ip, err := netip.ParseAddr(st.Value); err == nil {
			st.Value = net.JoinHostPort(ip.String(), strconv.Itoa(f.port))
		} else if _, _, err := net.SplitHostPort(st.Value); err != nil {
			return Setting{}, fmt.Errorf("field %q: %q is neither IP:PORT nor an IP address", path, st.Value)
		}
	case st.Value != "" || f.keepZero:
	case f.zero != "":
		st.Value = f.zero
	default:
		st.Default = true
	}
	return st, nil
}

// isIPv4 reports whether s is an IPv4 address (as kube-proxy decides the
// family of bindAddress: anything else counts as IPv6).
func isIPv4(s string) bool {
	ip, err := netip.ParseAddr(s)
	return err == nil && ip.Unmap().Is4()
}

// isZero reports whether v is a JSON value that sets nothing: null, "", 0, false,
// a zero duration or quantity ("0s", "0"), or a list or object of such values.
func isZero(v any) bool {
	switch x := v.(type) {
	case nil:
		return true
	case string:
		if x == "" || x == "0" {
			return true
		}
		d, err := time.ParseDuration(x)
		return err == nil && d == 0
	case bool:
		return !x
	case json.Number:
		f, err := x.Float64()
		return err == nil && f == 0
	case []any:
		for _, e := range x {
			if !isZero(e) {
				return false
			}
		}
		return true
	case map[string]any:
		for _, e := range x {
			if !isZero(e) {
				return false
			}
		}
		return true
	}
	return false
}

func jsonType(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	case json.Number:
		return "a number"
	case []any:
		return "a list"
	case map[string]any:
		return "an object"
	}
	return fmt.Sprintf("%T", v)
}
