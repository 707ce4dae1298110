"""Control-plane keys: ZeroMQ CURVE key pairs in a directory both ends are given.

`thc keys DIR` writes
  DIR/server.key, DIR/server.key_secret    the PS's pair (the PS reads the secret one)
  DIR/client.key, DIR/client.key_secret    the workers' pair (workers read the secret one
                                           and DIR/server.key, the PS's public key)
  DIR/authorized/client.key                the public keys the PS accepts
Give the PS host the whole directory and worker hosts client.key_secret and server.key;
more client pairs can be added to authorized/ (one per team or host).
"""
from __future__ import annotations

import os
from pathlib import Path


def create_keys(directory: str | Path) -> Path:
    """Make a key directory (refuses to overwrite one)."""
    import zmq.auth
    d = Path(directory)
    if (d / "server.key_secret").exists():
        raise ValueError(f"{d} already holds keys; remove it first or choose another directory")
    (d / "authorized").mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    zmq.auth.create_certificates(str(d), "server")
    client_public, _ = zmq.auth.create_certificates(str(d), "client")
    (d / "authorized" / "client.key").write_bytes(Path(client_public).read_bytes())
    for secret in d.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return d


def client_keys(directory: str | Path) -> tuple[bytes, bytes, bytes]:
    """(client secret, client public, server public) for a worker's CURVE socket."""
    import zmq.auth
    d = Path(directory)
    for name in ("client.key_secret", "server.key"):
        if not (d / name).is_file():
            raise ValueError(f"{d / name} is missing: a worker needs client.key_secret and server.key "
                             f"from the PS's key directory (`thc keys`)")
    public, secret = zmq.auth.load_certificate(str(d / "client.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(d / "server.key"))
    if secret is None:
        raise ValueError(f"{d / 'client.key_secret'} holds no secret key")
    return secret, public, server_public
