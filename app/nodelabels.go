package app

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

// nodeZone checks --node-labels (fromFiles: --services is given) and returns
// the zone they name ("" for none).
func nodeZone(labels map[string]string, fromFiles bool) (string, error) {
	if len(labels) == 0 {
		return "", nil
	}
	if !fromFiles {
		return "", errors.New("--node-labels: only with --services; with the API server the Node's own labels are used")
	}
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			return "", fmt.Errorf("--node-labels: key %q: %s", k, strings.Join(errs, "; "))
		}
		if errs := validation.IsValidLabelValue(labels[k]); len(errs) > 0 {
			return "", fmt.Errorf("--node-labels: %s=%q: %s", k, labels[k], strings.Join(errs, "; "))
		}
	}
	return labels[v1.LabelTopologyZone], nil
}
