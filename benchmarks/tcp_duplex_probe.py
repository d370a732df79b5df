"""Plain TCP between two testbed hosts: 16 MB one way, then 16 MB both ways at once (no gloo).

Shows whether two opposite flows between the same two hosts each get the link rate
(benchmarks/RESULTS.md §1, "Bus bandwidth on the testbed"). Run, as root::

    scaleout testbed up --hosts 2 --rate 1gbit --name si1
    ip netns exec so-si1-h0 python3 benchmarks/tcp_duplex_probe.py server 10.213.0.1 &
    ip netns exec so-si1-h1 python3 benchmarks/tcp_duplex_probe.py client 10.213.0.1
    scaleout testbed down --name si1
"""

import socket
import sys
import threading
import time

PORT = 29611
NBYTES = 16 << 20
BLOCK = b"x" * (1 << 20)


def send(sock: socket.socket) -> None:
    left = NBYTES
    while left > 0:
        left -= sock.send(BLOCK[:min(len(BLOCK), left)])


def recv(sock: socket.socket) -> None:
    left = NBYTES
    while left > 0:
        got = sock.recv(1 << 20)
        if not got:
            raise ConnectionError("peer closed early")
        left -= len(got)


def main(role: str, address: str) -> None:
    """``address``: host 0's (``scaleout testbed status``), where the server listens."""
    server = (address, PORT)
    if role == "server":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(server)
        listener.listen(1)
        listener.settimeout(60)
        sock, _ = listener.accept()
    else:
        time.sleep(1)
        sock = socket.create_connection(server, timeout=60)
    sock.settimeout(60)
    for mode in ("one way", "both ways"):
        if role == "client":
            sock.send(b"g")  # start together
        else:
            sock.recv(1)
        start = time.perf_counter()
        if mode == "one way":
            if role == "client":
                send(sock)
                sock.recv(1)  # the server has it all
            else:
                recv(sock)
                sock.send(b"k")
        else:
            sender = threading.Thread(target=send, args=(sock,))
            sender.start()
            recv(sock)
            sender.join(60)
        if role == "client":
            print(f"{mode}: {(time.perf_counter() - start) * 1e3:.1f} ms for 16 MB each way")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
