"""Raw TCP goodput for scripts/bench/bench-link-goodput.sh (no refit in it).

  tcp_goodput.py recv PORT N           accept N connections, drain them, print the goodput from
                                       the first byte to the last over all of them
  tcp_goodput.py send HOST PORT BYTES [AT]
                                       connect (retrying for 5 s), wait until time AT (epoch
                                       seconds; so that many senders start together), send BYTES
"""
import socket, sys, threading, time
if sys.argv[1] == "recv":
    port, n = int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    total = [0]; first = [None]; last = [0.0]; lock = threading.Lock()
    def drain(c):
        buf = bytearray(1 << 20)
        while True:
            k = c.recv_into(buf)
            if not k: break
            with lock:
                if first[0] is None: first[0] = time.time()
                total[0] += k; last[0] = time.time()
    ts = []
    for _ in range(n):
        c, _a = s.accept(); t = threading.Thread(target=drain, args=(c,)); t.start(); ts.append(t)
    for t in ts: t.join()
    dt = last[0] - first[0]
    print(f"recv {total[0]/1e6:.1f} MB in {dt:.2f} s = {total[0]*8/dt/1e6:.1f} Mbit/s over {n} flow(s)")
else:
    host, port, nbytes = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for _ in range(100):
        try:
            c = socket.create_connection((host, port)); break
        except OSError: time.sleep(0.05)
    if len(sys.argv) > 5:
        time.sleep(max(0.0, float(sys.argv[5]) - time.time()))
    chunk = b"x" * (1 << 20); sent = 0
    while sent < nbytes:
        c.sendall(chunk[: min(len(chunk), nbytes - sent)]); sent += min(len(chunk), nbytes - sent)
    c.close()
