"""The hot door's view of the daemon itself (forged.http.hotdoor.HotView)."""

from __future__ import annotations

from forged.auth import KeyEntry, KeyStore
from forged.http.access import count_request
from forged.http.modellist import model_list
from forged.http.responses import encode_json
from forged.http.state import AppState


class HubView:
    """The hot door's view of the daemon, read at each request: a reload applies."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    @property
    def on(self) -> bool:
        server = self.state.cfg.server
        return server.hot_door and not server.cors_origins

    @property
    def keys(self) -> KeyStore:
        return self.state.keys

    def health(self) -> tuple[int, bytes]:
        status, body = self.state.health()
        return status, encode_json(body)

    def models(self) -> bytes:
        return encode_json(model_list(self.state.models, int(self.state.started)))

    def count(self, rule: str, status: int, key: KeyEntry | None) -> None:
        count_request(self.state.metrics, rule, status, "none", key, "-")
