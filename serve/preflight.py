"""What ``vqserve serve`` checks before it binds a port or starts a process: that its ports
are free and its TLS pair loads. A mistake there is one line naming the setting to change,
not a failure reported later, from gRPC's own bind, in every front-end process."""

from __future__ import annotations

import contextlib
import errno
import socket
import ssl


class PortInUseError(OSError):
    """A port the server must bind is taken (``in_use``) or cannot be bound at all; ``role``
    says which ("gRPC" or "metrics") so the caller can name the setting that moves it."""

    IN_USE = "is already in use"

    def __init__(self, role: str, host: str, port: int, detail: str = IN_USE):
        shown = f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6
        super().__init__(errno.EADDRINUSE, f"{role} port {port} on {shown} {detail}")
        self.role, self.host, self.port = role, host, port
        self.in_use = detail == self.IN_USE

    def __str__(self) -> str:
        return self.strerror


def check_port_free(role: str, host: str, port: int) -> None:
    """Raise :class:`PortInUseError` if ``host:port`` is already bound by a listener, or
    ``host`` is not an address of this machine.

    Binding first with a throwaway socket (SO_REUSEADDR, as gRPC and the metrics server
    use) turns the common mistake into one clear error before gRPC logs its own bind
    failure; a port taken between this check and the real bind is still reported, by
    :meth:`TokenizerServer.start`. Other errors (a family turned off, no permission) are
    left to the real bind.
    """
    if port == 0:
        return
    bare = host.strip("[]") or None
    try:
        addresses = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # an unresolvable host: the real bind names it
    for family, kind, proto, _name, address in addresses:
        try:  # socket() itself fails where the family is off (IPv6 disabled): not our call
            with contextlib.closing(socket.socket(family, kind, proto)) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(role, host, port) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise PortInUseError(role, host, port, "cannot be bound: the address is not "
                                                       "one of this machine's") from None


class _EncryptedKey(Exception):
    pass


def _refuse_pass_phrase():
    raise _EncryptedKey


def check_tls_pair(cert: str | None, key: str | None) -> None:
    """A one-line ValueError unless ``cert`` and ``key`` are a PEM certificate chain and its
    private key that load together (both or neither given).

    Checked before any port is bound or process started: gRPC reads the files only when it
    binds, and then reports a bad pair as a port it "could not bind", in every front-end."""
    if not (cert or key):
        return
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    try:  # a key that asks for a pass phrase would make OpenSSL prompt on the terminal
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=_refuse_pass_phrase)
    except _EncryptedKey:
        raise ValueError(f"--tls-key {key} is encrypted (it asks for a pass phrase): gRPC needs the "
                         "private key unencrypted") from None
    except ssl.SSLError as exc:  # not PEM, or the key is not the certificate's
        why = exc.reason or str(exc)
    except OSError as exc:  # missing or unreadable
        why = exc.strerror or str(exc)
    else:
        return
    raise ValueError(f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate chain and its "
                     f"private key ({why})")


def check_before_start(cfg, port_reserved: bool = False) -> None:
    """What every serving process checks before it binds or starts anything, each mistake one
    line: the TLS pair and the gRPC port (unless ``port_reserved``: a front-end's executor
    checked the pair and reserved the port it shares), and an explicit metrics port."""
    if not port_reserved:
        check_tls_pair(cfg.tls_cert, cfg.tls_key)  # one line, before any port or process
        check_port_free("gRPC", cfg.host, cfg.port)
    if cfg.metrics_port > 0:
        check_port_free("metrics", cfg.metrics_host, cfg.metrics_port)
