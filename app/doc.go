// Package app is uproxy's command line: the commands, their flags, the
// configuration file, the validation of both, the proxy server they start and
// the node setup it needs. main.go only dispatches here; no other package
// imports this one.
//
// Where each command lives:
//
//	uproxy, uproxy run   root.go (the commands), server.go (runProxy: newServer
//	                     builds the server from the flags, server.Run runs it),
//	                     startmode.go (startMode: the mode from the registry)
//	uproxy version       root.go (the version set by the linker: -X .../app.version)
//	uproxy cleanup       cleanup.go (and uproxy --cleanup)
//	uproxy demo          demo.go
//	uproxy explain       explain.go
//	uproxy bench         bench.go (and bench report)
//	uproxy ab            ab.go
//	uproxy echo          echo.go (the backend uproxy ab expects)
//	iptables, ...        iptableswrapper.go (called by an iptables command's name)
//
// The flags and their checks, in the order a run takes them:
//
//	options.go           the flags of run and their defaults
//	configfile.go        --config: a KubeProxyConfiguration deciding the flags of its fields
//	validate.go          options -> config, each error naming its flag
//	flagchecks.go        the flags only some modes use; checks of --services and --bind-address
//	nodelabels.go        --node-labels
//
// The node setup a run does before the mode programs anything:
//
//	holder.go            --crash-holder: the parent that keeps the proxy sockets
//	                     through a crash of the server it starts (runHolder)
//	ruleslock.go         one uproxy per --chain-prefix programs the node's rules
//	takeover.go          --take-over: the handover to a successor on the rules lock
//	filelimit.go         the open file limit, raised to the hard limit
//	conntrack.go         the --conntrack-* flags and the sysctls they set
//
// report.go holds what bench, ab and echo share: reports, output files, an
// interruptible context.
package app
