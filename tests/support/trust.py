"""A CA bundle of one certificate, for test processes that never meet a real TLS peer.

Every Prefect API client builds a TLS context from its CA bundle when it is made, even
for an ``http://`` API, and httpx's default context (the Coder client's) reads one too:
certifi's ~150 certificates cost ~40 ms of CPU each time, and a flow run makes two to
four clients. Every server the tests run is plain HTTP on loopback, and the TLS tests
bring their own CA, so no certificate of the bundle is ever checked: one (certifi's
first) makes the same valid context ~40x cheaper. Were a test to reach an HTTPS server
with default trust, it would fail loudly, not go unverified.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import certifi


def one_certificate_bundle(prefix: str = "prefect-coder-ca-") -> Path:
    """Write a one-certificate PEM bundle to a fresh temp dir (removed at exit)."""
    pem = Path(certifi.where()).read_text()
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    first = pem[pem.index(begin) : pem.index(end) + len(end)]
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, directory, True)
    bundle = directory / "one-ca.pem"
    bundle.write_text(first + "\n")
    return bundle
