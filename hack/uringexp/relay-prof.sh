#!/bin/bash
# Per relay: system calls per connection (perf tracepoint count) and a cpu-clock profile, under 20000 connections from 4 clients.
U=/tmp/dp/uring/uringexp
$U backend 127.0.0.2:0 > /tmp/dp/be2.addr & BEPID=$!
sleep 0.3; BE=$(head -1 /tmp/dp/be2.addr)
for r in epoll uring main; do
  if [ $r = main ]; then
    (tail -f /dev/null | SOCKET_TEST_PROXY_TO=$BE /tmp/dp/socket-main.test -test.run='^$' > /tmp/dp/r.addr) & 
    sleep 0.5; PID=$(pgrep -n -f "socket-main.test -test.run")
  else
    $U relay-$r 127.0.0.1:0 $BE > /tmp/dp/r.addr & PID=$!
  fi
  sleep 0.3; A=$(head -1 /tmp/dp/r.addr)
  $U load $A 2000 4 >/dev/null
  echo "== $r (pid $PID) load=$(cut -d' ' -f1 /proc/loadavg)"
  perf stat -x, -e raw_syscalls:sys_enter -p $PID -- $U load $A 20000 4 2>&1 | cut -d, -f1,3
  perf record -q -e cpu-clock -F 4999 -g -o /tmp/dp/perf-$r.data -p $PID -- $U load $A 20000 4 2>&1 | grep conn
  perf trace -s -p $PID -- $U load $A 5000 4 2>&1 | grep -E "^\s+[a-z_0-9]+\s+[0-9]+" | sort -k2 -n -r | head -14
  kill $PID
done
kill $BEPID
