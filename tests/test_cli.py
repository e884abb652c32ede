"""The `swarm` command: keygen, inspect, demo; and the light `import swarm`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from swarm.cli.main import main
from swarm.identity import Identity


def test_import_swarm_is_light() -> None:
    code = ("import sys, swarm, swarm.content, swarm.cli.main; "
            "heavy = [m for m in ('torch', 'libp2p', 'vllm', 'trio') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_keygen_then_inspect(tmp_path: Path, capsys: object) -> None:
    key = tmp_path / "me.key"
    assert main(["keygen", "-o", str(key)]) == 0
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    peer_id = Identity.load(key).peer_id
    assert main(["inspect", str(key)]) == 0
    assert main(["keygen", "-o", str(key)]) == 2  # refuses to overwrite
    out = capsys.readouterr()  # type: ignore[attr-defined]
    assert peer_id in out.out and "already exists" in out.err


def test_inspect_manifest(tmp_path: Path, capsys: object) -> None:
    from swarm.content.layout import StateLayout
    from swarm.content.manifest import Manifest
    from swarm.content.pieces import piece_ids_of, state_root

    trainer = Identity.from_seed(b"k" * 32)
    layout = StateLayout.of([("w", "bfloat16", [4096])])
    ids = piece_ids_of([bytes(8192)], layout, 4096)
    sm = Manifest(run="r", step=3, kind="keyframe", base_root=None,
                  target_root=state_root(layout, ids, 4096), layout_digest=layout.digest,
                  codec="pieces", piece_size=4096, chunks=tuple((i, 4096) for i in ids)
                  ).sign(trainer)
    manifest = tmp_path / "step-3.manifest"
    manifest.write_bytes(sm.encode())
    assert main(["inspect", str(manifest), "--trainer", trainer.peer_id]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "signature     valid" in out and "step          3" in out
    assert "chunks        2 (8.0 KiB, 8192 bytes)" in out
    other = Identity.from_seed(b"z" * 32).peer_id
    assert main(["inspect", str(manifest), "--trainer", other]) == 2
    raw = bytearray(manifest.read_bytes())
    raw[len(raw) // 2] ^= 1
    manifest.write_bytes(bytes(raw))
    assert main(["inspect", str(manifest)]) == 2


def test_inspect_garbage_is_a_clean_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(os.urandom(100))
    out = subprocess.run([sys.executable, "-m", "swarm.cli.main", "inspect", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "swarm: error:" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_node_that_hangs_while_closing_still_exits_after_the_grace() -> None:
    """After Ctrl-C or SIGTERM a node has SHUTDOWN_GRACE seconds to close; a close that
    hangs (a connection that never finishes) ends the process with status 130 anyway."""
    import subprocess
    import sys
    import time

    code = ("import time\nfrom swarm.cli._node import _exit_after\n"
            "_exit_after(0.5)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 130 and time.monotonic() - t0 < 20
    assert "swarm: warning: still closing after 0.5 s; exiting now" in out.stderr


def test_the_memory_budget_flag_reaches_the_data_plane(tmp_path: Path) -> None:
    import argparse

    from swarm.cli._node import add_node_arguments, node_config

    p = argparse.ArgumentParser()
    add_node_arguments(p)
    args = p.parse_args(["--buffer-budget-mib", "64", "--data-dir", str(tmp_path)])
    cfg = node_config(args)
    assert cfg.data_plane is not None and cfg.data_plane.buffer_budget == 64 << 20
