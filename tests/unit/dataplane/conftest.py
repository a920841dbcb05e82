"""Fixtures of the data-plane tests: a TCP proxy in front of the loopback S3 server, to take it down and up."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.tcp_proxy import TcpProxy


@pytest.fixture
def s3_proxy(s3_server):
    """A ``TcpProxy`` in front of the moto server (``s3_proxy.url`` is an ``endpoint_url``); up when the test starts."""
    target = urlsplit(s3_server)
    with TcpProxy((target.hostname, target.port), seed=target.port) as proxy:
        yield proxy
