"""The server harness (calibrate/server.py) the tests, benchmarks and calibration start SGLang with: a port taken
between free_port() and SGLang's bind (SGLang then logs the bind error and waits forever) restarts the server on
a new port instead of waiting out the start-up timeout."""

from __future__ import annotations

import socket

import pytest
from helpers.testing import import_sglang_or_skip

import_sglang_or_skip()

from entmtp_sglang.calibrate.server import SGLangServer, cpu_args, free_port  # noqa: E402

pytestmark = pytest.mark.sglang


def test_free_port_never_hands_out_a_port_twice():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)


@pytest.mark.slow   # the test harness's own recovery (a server started twice): not the product
def test_a_taken_port_restarts_the_server_on_a_new_one(tmp_path, capfd):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = SGLangServer(cpu_args(None, extra=("--dtype", "float32")), taken, {}, tmp_path / "plain.log",
                              timeout_s=300)
        try:
            server.start()
            assert server.port != taken
            out = server.generate("def add(a, b):", 4)
            assert len(out["output_ids"]) == 4
        finally:
            server.stop()
    assert f"could not bind port {taken}" in capfd.readouterr().err
