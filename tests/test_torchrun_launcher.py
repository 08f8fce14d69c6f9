"""The tests' torchrun launcher (tests/_torchrun.py): a worker's own error fails at once with its traceback in
the report; a transport error is the only kind tried again."""

from __future__ import annotations

import pytest
from _torchrun import TRANSPORT_FAILURE, torchrun

pytestmark = pytest.mark.distributed

WORKER = """
import os, sys
rank = int(os.environ["RANK"])
with open(sys.argv[1] + f".{rank}", "w") as f:
    f.write(os.environ.get("GLOO_SOCKET_IFNAME", "") + " " + os.environ["OMP_NUM_THREADS"])
if rank == 1:
    raise ValueError("boom from rank 1")
"""


def test_a_worker_error_fails_once_with_its_traceback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    marker = tmp_path / "ran"
    with pytest.raises(pytest.fail.Exception) as failed:
        torchrun([str(script), str(marker)], timeout=120)
    report = str(failed.value)
    assert "ValueError: boom from rank 1" in report and "try 1 of 2" in report
    assert (tmp_path / "ran.0").read_text().split()[-1] == "1"  # one OpenMP thread per rank


def test_only_transport_failures_are_tried_again():
    assert TRANSPORT_FAILURE.search("torch.distributed.DistNetworkError: The client socket has timed out")
    assert TRANSPORT_FAILURE.search("RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    assert TRANSPORT_FAILURE.search("RuntimeError: Address already in use")
    assert not TRANSPORT_FAILURE.search("AssertionError: grad norms differ")
    assert not TRANSPORT_FAILURE.search("ValueError: boom from rank 1")
