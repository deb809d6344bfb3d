package service

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
)

func errorStrings(errs []error) []string {
	var out []string
	for _, err := range errs {
		out = append(out, err.Error())
	}
	return out
}

func TestValidateService(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		svc  *v1.Service
		want []string
	}{
		{name: "valid", svc: testService("default", "web")},
		{
			name: "missing name and namespace",
			svc:  testService("", ""),
			want: []string{"Service /: metadata.name: required", "Service /: metadata.namespace: required"},
		},
		{
			name: "headless Service only checked for its name",
			svc:  testService("default", "", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP, s.Ports = "None", []v1.ServicePort{{Port: 0}} })),
			want: []string{"Service default/: metadata.name: required"},
		},
		{
			name: "unsupported type",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.Type = "Magic" })),
			want: []string{`Service default/web: spec.type: unsupported value "Magic"`},
		},
		{
			name: "bad cluster IP",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP = "10.96.0.300" })),
			want: []string{`Service default/web: spec.clusterIP: "10.96.0.300" is not a valid IP address`},
		},
		{
			name: "zoned cluster IP",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.ClusterIP, s.ClusterIPs = "", []string{"fe80::1%eth0"} })),
			want: []string{`Service default/web: spec.clusterIPs[0]: "fe80::1%eth0" is not a valid IP address`},
		},
		{
			name: "clusterIPs not starting with clusterIP",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.ClusterIPs = []string{"10.96.0.11"} })),
			want: []string{"Service default/web: spec.clusterIPs[0]: 10.96.0.11 does not match spec.clusterIP 10.96.0.10"},
		},
		{
			name: "two cluster IPs of one family",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.ClusterIPs = []string{"10.96.0.10", "10.96.0.11"} })),
			want: []string{"Service default/web: spec.clusterIPs[1]: 10.96.0.11 is IPv4 like spec.clusterIPs[0]; a dual-stack Service needs one address of each family"},
		},
		{
			name: "three cluster IPs",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.ClusterIPs = []string{"10.96.0.10", "fd00::10", "fd00::11"}
			})),
			want: []string{"Service default/web: spec.clusterIPs: 3 addresses, at most 2 (one per IP family)"},
		},
		{
			name: "cluster IP family differs from ipFamilies",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.ClusterIPs = []string{"10.96.0.10", "fd00::10"}
				s.IPFamilies = []v1.IPFamily{v1.IPv6Protocol, v1.IPv4Protocol}
			})),
			want: []string{
				"Service default/web: spec.clusterIPs[0]: 10.96.0.10 is IPv4 but spec.ipFamilies[0] is IPv6",
				"Service default/web: spec.clusterIPs[1]: fd00::10 is IPv6 but spec.ipFamilies[1] is IPv4",
			},
		},
		{
			name: "bad external IP",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.ExternalIPs = []string{"192.0.2.1", "example.com"} })),
			want: []string{`Service default/web: spec.externalIPs[1]: "example.com" is not a valid IP address`},
		},
		{
			name: "bad load balancer ingress IP",
			svc: testService("default", "web", func(s *v1.Service) {
				s.Status.LoadBalancer.Ingress = []v1.LoadBalancerIngress{{Hostname: "lb.example"}, {IP: "203.0.113"}}
			}),
			want: []string{`Service default/web: status.loadBalancer.ingress[1].ip: "203.0.113" is not a valid IP address`},
		},
		{
			name: "bad source range",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.LoadBalancerSourceRanges = []string{"10.0.0.0/33"} })),
			want: []string{`Service default/web: spec.loadBalancerSourceRanges[0]: "10.0.0.0/33" is not a valid CIDR`},
		},
		{
			name: "no ports",
			svc:  testService("default", "web", withPorts()),
			want: []string{"Service default/web: spec.ports: required"},
		},
		{
			name: "port out of range",
			svc:  testService("default", "web", withPorts(v1.ServicePort{Name: "a", Port: 80}, v1.ServicePort{Name: "b", Port: 70000})),
			want: []string{"Service default/web: spec.ports[1].port: 70000 is out of range 1-65535"},
		},
		{
			name: "port zero",
			svc:  testService("default", "web", withPorts(v1.ServicePort{Port: 0})),
			want: []string{"Service default/web: spec.ports[0].port: 0 is out of range 1-65535"},
		},
		{
			name: "unknown protocol",
			svc:  testService("default", "web", withPorts(v1.ServicePort{Port: 80, Protocol: "ICMP"})),
			want: []string{`Service default/web: spec.ports[0].protocol: unsupported value "ICMP" (want TCP, UDP or SCTP)`},
		},
		{
			name: "node port out of range",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.Type = v1.ServiceTypeNodePort
				s.Ports[0].NodePort = -1
			})),
			want: []string{"Service default/web: spec.ports[0].nodePort: -1 is out of range 1-65535"},
		},
		{
			name: "node port on a ClusterIP Service",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.Ports[0].NodePort = 30080 })),
			want: []string{"Service default/web: spec.ports[0].nodePort: may not be set when type is ClusterIP"},
		},
		{
			name: "duplicate node port",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.Type = v1.ServiceTypeNodePort
				s.Ports = []v1.ServicePort{{Name: "a", Port: 80, NodePort: 30080}, {Name: "b", Port: 81, NodePort: 30080}}
			})),
			want: []string{"Service default/web: spec.ports[1].nodePort: 30080/TCP is already used by spec.ports[0]"},
		},
		{
			name: "health check node port out of range",
			svc:  testService("default", "web", withSpec(func(s *v1.ServiceSpec) { s.HealthCheckNodePort = 65536 })),
			want: []string{"Service default/web: spec.healthCheckNodePort: 65536 is out of range 1-65535"},
		},
		{
			name: "duplicate port and protocol, with the default protocol spelled out once",
			svc:  testService("default", "web", withPorts(v1.ServicePort{Name: "a", Port: 80}, v1.ServicePort{Name: "b", Port: 80, Protocol: v1.ProtocolTCP})),
			want: []string{"Service default/web: spec.ports[1]: 80/TCP is already used by spec.ports[0]"},
		},
		{
			name: "same port on two protocols is fine",
			svc:  testService("default", "web", withPorts(v1.ServicePort{Name: "a", Port: 53, Protocol: v1.ProtocolUDP}, v1.ServicePort{Name: "b", Port: 53})),
		},
		{
			name: "duplicate port name",
			svc:  testService("default", "web", withPorts(v1.ServicePort{Name: "http", Port: 80}, v1.ServicePort{Name: "http", Port: 8080})),
			want: []string{`Service default/web: spec.ports[1].name: "http" is already used by spec.ports[0]`},
		},
		{
			name: "missing port name in a multi-port Service",
			svc:  testService("default", "web", withPorts(v1.ServicePort{Name: "http", Port: 80}, v1.ServicePort{Port: 443})),
			want: []string{"Service default/web: spec.ports[1].name: required when a Service has several ports"},
		},
		{
			name: "affinity timeout zero",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.SessionAffinity = v1.ServiceAffinityClientIP
				s.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr(int32(0))}}
			})),
			want: []string{"Service default/web: spec.sessionAffinityConfig.clientIP.timeoutSeconds: 0 is out of range 1-86400"},
		},
		{
			name: "affinity timeout over a day",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.SessionAffinity = v1.ServiceAffinityClientIP
				s.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr(int32(86401))}}
			})),
			want: []string{"Service default/web: spec.sessionAffinityConfig.clientIP.timeoutSeconds: 86401 is out of range 1-86400"},
		},
		{
			name: "affinity timeout of a day is fine",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.SessionAffinity = v1.ServiceAffinityClientIP
				s.SessionAffinityConfig = &v1.SessionAffinityConfig{ClientIP: &v1.ClientIPConfig{TimeoutSeconds: ptr(int32(86400))}}
			})),
		},
		{
			name: "unknown affinity and policies",
			svc: testService("default", "web", withSpec(func(s *v1.ServiceSpec) {
				s.SessionAffinity = "Cookie"
				s.ExternalTrafficPolicy = "Nearest"
				s.InternalTrafficPolicy = ptr(v1.ServiceInternalTrafficPolicy("local"))
			})),
			want: []string{
				`Service default/web: spec.sessionAffinity: unsupported value "Cookie"`,
				`Service default/web: spec.externalTrafficPolicy: unsupported value "Nearest"`,
				`Service default/web: spec.internalTrafficPolicy: unsupported value "local"`,
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			errs := ValidateService(tt.svc)
			got := errorStrings(errs)
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
			for _, err := range errs {
				var fe *FieldError
				if !errors.As(err, &fe) {
					t.Errorf("got %T, want *FieldError", err)
				}
			}
		})
	}
}

func TestValidateEndpointSlice(t *testing.T) {
	t.Parallel()
	v4 := discoveryv1.AddressTypeIPv4
	tests := []struct {
		name  string
		slice *discoveryv1.EndpointSlice
		want  []string
	}{
		{name: "valid", slice: testSlice("default", "web-1", "web", v4, slicePorts(":8080"), testEndpoint(addrs("10.0.0.1")))},
		{
			name:  "missing name",
			slice: testSlice("default", "", "web", v4, nil),
			want:  []string{"EndpointSlice default/: metadata.name: required"},
		},
		{
			name:  "missing service name label",
			slice: testSlice("default", "web-1", "", v4, nil),
			want:  []string{"EndpointSlice default/web-1: metadata.labels[kubernetes.io/service-name]: required"},
		},
		{
			name:  "unknown address type",
			slice: testSlice("default", "web-1", "web", "IPv5", nil),
			want:  []string{`EndpointSlice default/web-1: addressType: unsupported value "IPv5" (want IPv4, IPv6 or FQDN)`},
		},
		{
			name:  "FQDN slice not checked further",
			slice: testSlice("default", "web-1", "", discoveryv1.AddressTypeFQDN, slicePorts(":0"), testEndpoint(addrs("not an address"))),
		},
		{
			name:  "bad address",
			slice: testSlice("default", "web-1", "web", v4, nil, testEndpoint(addrs("10.0.0.1")), testEndpoint(addrs("10.0.0.1", "10.0.0"))),
			want:  []string{`EndpointSlice default/web-1: endpoints[1].addresses[1]: "10.0.0" is not a valid IP address`},
		},
		{
			name:  "IPv4 address in an IPv6 slice",
			slice: testSlice("default", "web-1", "web", discoveryv1.AddressTypeIPv6, nil, testEndpoint(addrs("fd00::1", "10.0.0.1"))),
			want:  []string{"EndpointSlice default/web-1: endpoints[0].addresses[1]: 10.0.0.1 is not an IPv6 address (addressType IPv6)"},
		},
		{
			name:  "endpoint without addresses",
			slice: testSlice("default", "web-1", "web", v4, nil, testEndpoint()),
			want:  []string{"EndpointSlice default/web-1: endpoints[0].addresses: required"},
		},
		{
			name:  "port out of range",
			slice: testSlice("default", "web-1", "web", v4, slicePorts("a:80", "b:65536")),
			want:  []string{"EndpointSlice default/web-1: ports[1].port: 65536 is out of range 1-65535"},
		},
		{
			name:  "unknown protocol",
			slice: testSlice("default", "web-1", "web", v4, slicePorts(":80/QUIC")),
			want:  []string{`EndpointSlice default/web-1: ports[0].protocol: unsupported value "QUIC" (want TCP, UDP or SCTP)`},
		},
		{
			name:  "duplicate port name",
			slice: testSlice("default", "web-1", "web", v4, slicePorts("http:80", "http:81")),
			want:  []string{`EndpointSlice default/web-1: ports[1].name: "http" is already used by ports[0]`},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := errorStrings(ValidateEndpointSlice(tt.slice))
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
		})
	}
}
