// Package proxyconfig reads a kube-proxy configuration file
// (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1) and maps the part of
// it that uproxy understands onto uproxy's command-line flags, so that a node's
// existing kube-proxy configuration can be reused as it is.
//
//	settings, ignored, err := proxyconfig.Load("/var/lib/uproxy/config.conf")
//	for _, s := range settings {
//		if !flags.Changed(s.Flag) { // flags given explicitly win
//			flags.Set(s.Flag, s.Value)
//		}
//	}
//
// Fields that kube-proxy knows and uproxy has no use for (conntrack, masquerade
// bits, feature gates, ...) are accepted and reported as ignored when they hold a
// value; any other field is an error that names it.
package proxyconfig

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
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
}

func (s Setting) String() string { return fmt.Sprintf("%s -> --%s=%s", s.Field, s.Flag, s.Value) }

// kind says how a field's value is read.
type kind int

const (
	ignored  kind = iota // known to kube-proxy, unused here: any value
	str                  // a string
	duration             // a Go duration string ("30s"), as metav1.Duration
	number               // a JSON number
	strList              // a list of strings, joined with commas
)

type field struct {
	kind kind
	flag string
	// section, for the per-mode sync periods, is the mode whose section the field
	// belongs to; it applies only when that mode is the file's mode.
	section string
}

// schema is KubeProxyConfiguration v1alpha1: every field, with the flag it maps
// to. A nested map is an object whose fields are listed; a field of kind ignored
// accepts anything beneath it.
var schema = map[string]any{
	"apiVersion": field{kind: str},
	"kind":       field{kind: str},
	"clientConnection": map[string]any{
		"kubeconfig":         field{kind: str, flag: "kubeconfig"},
		"qps":                field{kind: number, flag: "kube-api-qps"},
		"burst":              field{kind: number, flag: "kube-api-burst"},
		"contentType":        field{kind: str, flag: "kube-api-content-type"},
		"acceptContentTypes": field{kind: ignored},
	},
	"hostnameOverride":   field{kind: str, flag: "hostname-override"},
	"bindAddress":        field{kind: str, flag: "bind-address"},
	"healthzBindAddress": field{kind: str, flag: "healthz-bind-address"},
	"metricsBindAddress": field{kind: str, flag: "metrics-bind-address"},
	"mode":               field{kind: str, flag: "proxy-mode"},
	"nodePortAddresses":  field{kind: strList, flag: "nodeport-addresses"},
	"configSyncPeriod":   field{kind: duration, flag: "config-sync-period"},
	// portRange and udpIdleTimeout configured kube-proxy's own userspace mode,
	// whose proxy ports and UDP idle timeout uproxy's flags are.
	"portRange":      field{kind: str, flag: "proxy-port-range"},
	"udpIdleTimeout": field{kind: duration, flag: "udp-timeout"},
	"iptables": map[string]any{
		"syncPeriod":         field{kind: duration, flag: "sync-period", section: "iptables"},
		"minSyncPeriod":      field{kind: duration, flag: "min-sync-period", section: "iptables"},
		"masqueradeBit":      field{kind: ignored},
		"masqueradeAll":      field{kind: ignored},
		"localhostNodePorts": field{kind: ignored},
	},
	"ipvs": map[string]any{
		"syncPeriod":    field{kind: duration, flag: "sync-period", section: "ipvs"},
		"minSyncPeriod": field{kind: duration, flag: "min-sync-period", section: "ipvs"},
		// uproxy's schedulers are IPVS's, by the same names.
		"scheduler":     field{kind: str, flag: "scheduler"},
		"excludeCIDRs":  field{kind: ignored},
		"strictARP":     field{kind: ignored},
		"tcpTimeout":    field{kind: ignored},
		"tcpFinTimeout": field{kind: ignored},
		"udpTimeout":    field{kind: ignored},
	},
	"nftables": map[string]any{
		"syncPeriod":    field{kind: duration, flag: "sync-period", section: "nftables"},
		"minSyncPeriod": field{kind: duration, flag: "min-sync-period", section: "nftables"},
		"masqueradeBit": field{kind: ignored},
		"masqueradeAll": field{kind: ignored},
	},
	"conntrack": map[string]any{
		"maxPerCore":            field{kind: ignored},
		"min":                   field{kind: ignored},
		"tcpEstablishedTimeout": field{kind: ignored},
		"tcpCloseWaitTimeout":   field{kind: ignored},
		"tcpBeLiberal":          field{kind: ignored},
		"udpTimeout":            field{kind: ignored},
		"udpStreamTimeout":      field{kind: ignored},
	},
	"detectLocal": map[string]any{
		"bridgeInterface":     field{kind: ignored},
		"interfaceNamePrefix": field{kind: ignored},
	},
	"featureGates":                field{kind: ignored},
	"logging":                     field{kind: ignored},
	"bindAddressHardFail":         field{kind: ignored},
	"enableProfiling":             field{kind: ignored},
	"showHiddenMetricsForVersion": field{kind: ignored},
	"winkernel":                   field{kind: ignored},
	"detectLocalMode":             field{kind: ignored},
	"clusterCIDR":                 field{kind: ignored},
	"oomScoreAdj":                 field{kind: ignored},
	"windowsRunAsService":         field{kind: ignored},
}

// Load reads the configuration file at path; see Parse.
func Load(path string) (settings []Setting, ignoredFields []string, err error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, fmt.Errorf("config file: %w", err)
	}
	settings, ignoredFields, err = Parse(data)
	if err != nil {
		return nil, nil, fmt.Errorf("config file %s: %w", path, err)
	}
	return settings, ignoredFields, nil
}

// Parse reads a KubeProxyConfiguration in YAML or JSON. It returns the settings
// for uproxy's flags, ordered by field path, and the fields that hold a value
// uproxy does not use. Unknown fields, duplicate keys, values of the wrong type
// and any other apiVersion or kind are errors.
//
// The sync periods are taken from the section of the file's mode (iptables when
// the mode is empty, "userspace" or "iptables"), as kube-proxy does; the other
// sections' periods are ignored.
func Parse(data []byte) (settings []Setting, ignoredFields []string, err error) {
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

	w := walker{section: section}
	if err := w.object("", doc, schema); err != nil {
		return nil, nil, err
	}
	return w.settings, w.ignored, nil
}

type walker struct {
	section  string
	settings []Setting
	ignored  []string
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
	if f.kind == ignored || (f.section != "" && f.section != w.section) {
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
		value = d.String()
	case number:
		n, ok := v.(json.Number)
		if !ok {
			return fmt.Errorf("field %q: want a number, got %s", path, jsonType(v))
		}
		value = n.String()
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
	}
	w.settings = append(w.settings, Setting{Field: path, Flag: f.flag, Value: value})
	return nil
}

// isZero reports whether v is a JSON value that sets nothing: null, "", 0, false,
// or an empty list or object.
func isZero(v any) bool {
	switch x := v.(type) {
	case nil:
		return true
	case string:
		return x == ""
	case bool:
		return !x
	case json.Number:
		f, err := x.Float64()
		return err == nil && f == 0
	case []any:
		return len(x) == 0
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
