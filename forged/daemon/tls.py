"""TLS on the API listener, with certificates renewed by a reload.

hypercorn builds its SSL context once, when it binds. forged builds it instead and
keeps it: a reload loads the certificate files into the same context again, and every
handshake from then on uses the new certificate, while open connections keep theirs.
"""

from __future__ import annotations

import logging
import ssl

from hypercorn.config import Config as HyperConfig

log = logging.getLogger("forged")


class TLS:
    def __init__(self, cert: str, key: str) -> None:
        """Raises OSError or ssl.SSLError if the files cannot be read as a pair."""
        self.cert, self.key = cert, key
        hc = HyperConfig()  # hypercorn's own settings: TLS 1.2+, its ciphers and ALPN
        hc.certfile, hc.keyfile = cert, key
        context = hc.create_ssl_context()
        assert context is not None  # both files given
        self.context = context

    def serve_with(self, hc: HyperConfig) -> None:
        """Make ``hc`` listen with TLS, on this context."""
        hc.certfile, hc.keyfile = self.cert, self.key
        hc.create_ssl_context = lambda: self.context  # type: ignore[method-assign]

    def reload(self) -> None:
        """Read the files again; if they cannot be read, keep serving the old pair."""
        try:
            # A scratch context first: OpenSSL installs the certificate before it reads
            # the key, so a key that fails (or does not match) would leave the served
            # context with the new certificate and the old key, and no handshake works.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
            self.context.load_cert_chain(certfile=self.cert, keyfile=self.key)
        except (OSError, ssl.SSLError) as exc:
            log.error("reload: TLS certificate %s or key %s unreadable, the old pair is "
                      "kept: %s", self.cert, self.key, exc)
            return
        log.info("reload: TLS certificate %s read again", self.cert)
