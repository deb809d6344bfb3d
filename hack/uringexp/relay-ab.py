#!/usr/bin/env python3
"""Interleaved CPU per short connection of several relays under one load generator.

Each relay runs in its own process; its CPU (utime+stime from /proc, 10 ms ticks)
is read around a load of N connections (connect, 64 B, 64 B back, close) from C
clients. Usage: relay-ab.py RUNS N C relay...   (relays: epoll uring main lazy)
"""
import os, subprocess, sys, time

U = "/tmp/dp/uring/uringexp"
runs, n, c = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4:]

def start(args, env=None, stdin=None):
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stdin=stdin, env=env, text=True)
    return p, p.stdout.readline().strip()

procs = []
be, be_addr = start([U, "backend", "127.0.0.2:0"]); procs.append(be)
relays = {}
for name in names:
    if name in ("epoll", "uring"):
        p, addr = start([U, "relay-" + name, "127.0.0.1:0", be_addr])
    else:  # a socket test binary in its proxy mode (TCPProxy, default keepalive)
        env = dict(os.environ, SOCKET_TEST_PROXY_TO=be_addr)
        p, addr = start(["/tmp/dp/socket-%s.test" % name, "-test.run=^$"], env=env, stdin=subprocess.PIPE)
    procs.append(p)
    relays[name] = (p, addr)

def ticks(pid):
    f = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])

try:
    for name in names:  # warm-up
        subprocess.run([U, "load", relays[name][1], "2000", str(c)], check=True, capture_output=True)
    for r in range(runs):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            p, addr = relays[name]
            load = open("/proc/loadavg").read().split()[0]
            t0 = ticks(p.pid)
            out = subprocess.run([U, "load", addr, str(n), str(c)], check=True, capture_output=True, text=True).stdout.strip()
            t1 = ticks(p.pid)
            rate = out.split(": ")[1]
            print("run %d %-6s relay CPU %6.1f µs/conn  %s  load %s" % (r + 1, name, (t1 - t0) * 10000.0 / n, rate, load), flush=True)
finally:
    for p in procs:
        p.kill()
