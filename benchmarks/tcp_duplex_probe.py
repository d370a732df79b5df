"""Plain TCP between two testbed hosts: 16 MB one way, then 16 MB both ways at once (no gloo).

Run as in benchmarks/RESULTS.md §1 (server in so-si1-h0, client in so-si1-h1)."""
import socket, sys, threading, time
role, n = sys.argv[1], 16 << 20
buf = b"x" * (1 << 20)
def send(s):
    left = n
    while left > 0:
        left -= s.send(buf[:min(len(buf), left)])
def recv(s):
    left = n
    while left > 0:
        left -= len(s.recv(1 << 20))
if role == "server":
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("10.213.0.1", 29611)); ls.listen(1); s, _ = ls.accept()
else:
    time.sleep(1); s = socket.create_connection(("10.213.0.1", 29611))
for mode in ("one way", "both ways"):
    s.send(b"g") if role == "client" else s.recv(1)
    t = time.perf_counter()
    if mode == "one way":
        send(s) if role == "client" else recv(s)
        (s.recv(1) if role == "client" else s.send(b"k"))
    else:
        th = threading.Thread(target=send, args=(s,)); th.start(); recv(s); th.join()
    if role == "client":
        print(f"{mode}: {(time.perf_counter() - t) * 1e3:.1f} ms for 16 MB each way")
