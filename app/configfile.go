package app

import (
	"fmt"
	"strings"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/proxyconfig"
)

// applyConfigFile applies --config as kube-proxy v1.36 does: every flag that
// stands for a field of the KubeProxyConfiguration takes the file's value, or
// kube-proxy's default when the file leaves the field out or zero, and the
// command line's value of such a flag is ignored (with a warning here; kube-proxy
// is silent). The one exception among them is --hostname-override, which wins
// when given, as in kube-proxy. Flags without a field (--master, -v, uproxy's
// own) apply as given. What it has to say is logged by logConfigNotes, once
// the flags are known to be good.
func (o *options) applyConfigFile() error {
	if o.configFile == "" || o.flags == nil {
		return nil
	}
	settings, ignored, err := proxyconfig.Load(o.configFile)
	if err != nil {
		return fmt.Errorf("--config %w", err) // "--config FILE: ...": Load's errors begin with the file
	}
	for _, field := range ignored {
		o.note("Ignoring a kube-proxy setting uproxy does not use", "config", o.configFile, "field", field)
	}
	o.configFields = map[string]proxyconfig.Setting{}
	for _, st := range settings {
		fl := o.flags.Lookup(st.Flag)
		if fl == nil {
			return fmt.Errorf("--config %s: field %q: %q is not supported (no --%s flag)", o.configFile, st.Field, st.Value, st.Flag)
		}
		if st.Flag == "hostname-override" && fl.Changed && o.hostnameOverride != "" {
			if strings.TrimSpace(o.hostnameOverride) == "" {
				return fmt.Errorf("--hostname-override %q: empty once spaces are trimmed", o.hostnameOverride)
			}
			continue
		}
		value := st.Value
		if st.Default {
			value = fl.DefValue
		}
		if fl.Changed {
			o.note("Ignoring a flag that --config sets, as kube-proxy does", "flag", "--"+st.Flag, "given", fl.Value.String(), "config", o.configFile, "field", st.Field, "value", value)
		}
		if err := o.flags.Set(st.Flag, value); err != nil {
			// The flag set's error names the flag: the value's own says
			// what is wrong with the field.
			if verr := fl.Value.Set(value); verr != nil {
				err = verr
			}
			return fmt.Errorf("--config %s: field %q: %w", o.configFile, st.Field, err)
		}
		o.configFields[st.Flag] = st
	}
	return nil
}

// configNote is a line for the log, held until the flags are checked.
type configNote struct {
	msg           string
	keysAndValues []any
}

// note holds a line of applyConfigFile's for logConfigNotes.
func (o *options) note(msg string, keysAndValues ...any) {
	o.configNotes = append(o.configNotes, configNote{msg, keysAndValues})
}

// logConfigNotes logs what applyConfigFile had to say. The caller calls it
// once every flag is checked: a start that a bad flag refuses logs nothing
// before its error.
func (o *options) logConfigNotes() {
	for _, n := range o.configNotes {
		klog.InfoS(n.msg, n.keysAndValues...)
	}
	o.configNotes = nil
}

// configFieldError rewrites an error of validate about a flag that --config
// set so that it names the file and the field instead (validate's errors begin
// with the flag).
func (o *options) configFieldError(err error) error {
	msg := err.Error()
	for flag, st := range o.configFields {
		rest, ok := strings.CutPrefix(msg, "--"+flag)
		if ok && (rest == "" || rest[0] == ' ' || rest[0] == ':' || rest[0] == ',') {
			return &renamedError{msg: fmt.Sprintf("--config %s: field %q%s", o.configFile, st.Field, rest), err: err}
		}
	}
	return err
}

// renamedError is an error with another message, which still unwraps to it.
type renamedError struct {
	msg string
	err error
}

func (e *renamedError) Error() string { return e.msg }
func (e *renamedError) Unwrap() error { return e.err }
