"""What a new user meets when something is off (issue 43, "Messages and exit codes"): each
test reproduces one finding and failed before its fix."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proto.job import JobConfig
from proto.keys import HandshakeFailed, create_keys
from ps_server.server import PSServer
from worker.transport import Transport

ROOT = Path(__file__).resolve().parents[1]


def thc(*argv, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "deploy.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kw)


def _client_dir(d: Path, client_from: Path, server_from: Path) -> Path:
    """A worker's key directory: client.key_secret of one `thc keys` directory, server.key of another."""
    d.mkdir()
    shutil.copy(client_from / "client.key_secret", d / "client.key_secret")
    shutil.copy(server_from / "server.key", d / "server.key")
    return d


@pytest.mark.parametrize("which,cause", [
    ("none", "the PS runs with --keys (CURVE) and this client has no keys: pass --keys DIR"),
    ("unauthorized", "the PS refused this client's key: its public key is not in the PS's keys/authorized/"),
    ("other server", "this client's server.key is not that PS's public key"),
])
def test_keys_that_do_not_fit_are_named_at_once_by_both_ends(tmp_path, which, cause):
    """Reproduction: unauthorized keys waited 32 s for "no reply from the PS control plane", with
    no word of keys, and the PS logged nothing.  The worker's wait here is 60 s: the
    error must come from the failed handshake, not from the timeout."""
    keys, other = create_keys(tmp_path / "keys"), create_keys(tmp_path / "other")
    client = {"none": lambda: None, "unauthorized": lambda: _client_dir(tmp_path / "c", other, keys),
              "other server": lambda: _client_dir(tmp_path / "c", keys, other)}[which]()
    lines = []
    server = PSServer(JobConfig(num_workers=1), ("127.0.0.1", 0), control_port=0, keys=keys,
                      log=lines.append).start()
    try:
        with pytest.raises(HandshakeFailed) as exc:
            Transport("127.0.0.1", server.data_addr[1], 0, control_port=server.control_port,
                      keys=client, control_timeout_s=60)
        assert cause in str(exc.value)
        assert f"tcp://127.0.0.1:{server.control_port} refused the connection" in str(exc.value)
    finally:
        server.stop()
    said = [line for line in lines if "CURVE handshake refused" in line]
    assert said and said[0].startswith("WARNING: control plane: CURVE handshake refused: ")
    ps_cause = {"none": "a client without keys", "unauthorized": "not among this PS's authorized keys",
                "other server": "another PS's server.key"}[which]
    assert ps_cause in said[0]
