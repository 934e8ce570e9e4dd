"""The worker's transport: per-peer links of several kinds behind one interface
(_link_interface.py), the one transport they plug into (_link.py, with its in-place waits in
_in_place.py and its loop polling in _loop_polling.py), the one factory that picks a kind per peer
(_factory.py), what the kinds share (_kind.py), and the kinds (tcp, shm; memory for tests).

Imports only foundations and the modules of this package; never the public surface.
"""

from ._factory import (
    TRANSPORT_ENV,
    LinkKind,
    PeerRow,
    choose_link_kinds,
    connect_links,
    host_identity,
    listen_addresses,
    open_transport,
    transport_choice,
)
from ._link import Link, LinkHost, LinkTransport

__all__ = [
    "TRANSPORT_ENV",
    "Link",
    "LinkHost",
    "LinkKind",
    "LinkTransport",
    "PeerRow",
    "choose_link_kinds",
    "connect_links",
    "host_identity",
    "listen_addresses",
    "open_transport",
    "transport_choice",
]
