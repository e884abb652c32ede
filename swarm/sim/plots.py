"""Plots of the simulator's results (matplotlib on the Agg backend, imported on use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from swarm.errors import LocalProtocolError


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend.

    :raises LocalProtocolError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise LocalProtocolError("the plot needs matplotlib (pip install matplotlib)"
                                 ) from exc
    return plt


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    """Distribution time and trainer egress vs number of peers, swarm vs baselines."""
    plt = pyplot()
    peers = [r["peers"] for r in rows]
    names = [m["name"] for m in rows[0]["methods"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, name in enumerate(names):
        ax1.plot(peers, [r["methods"][k]["completion_s"] for r in rows], marker="o",
                 label=name)
        egress = [r["methods"][k]["trainer_egress_gb"] for r in rows]
        ax2.plot(peers, egress, marker="o", label=name)
    ax1.plot(peers, [r["lower_bound_s"] for r in rows], "k--", label="lower bound")
    for ax, title, unit in ((ax1, "time until every peer holds the step", "seconds"),
                            (ax2, "trainer egress per step", "GB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("peers")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
