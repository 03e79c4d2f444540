"""The image from deploy/Dockerfile, built and run with a real container runtime: it answers a chat
completion through the official client, runs as a non-root user, passes its own HEALTHCHECK and
exits cleanly on SIGTERM (all in deploy/build_image.sh, which is also the check to run by hand).

Needs podman and debootstrap (`.ci/run` installs them from Debian's packages when it runs as root)
and a machine where containers can start; where they cannot, the test says why and skips."""
import os
import pathlib
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.slow
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _why_not() -> str | None:
    if shutil.which("podman") is None or shutil.which("debootstrap") is None:
        return "podman and debootstrap are not installed (.ci/run installs them as root; or run deploy/build_image.sh)"
    if os.geteuid() != 0:
        return "debootstrap needs root"
    return None


@pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))
def test_the_image_builds_runs_and_answers_a_chat_completion():
    r = subprocess.run(["bash", str(ROOT / "deploy" / "build_image.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=1800, env={**os.environ, "PY": str(ROOT / ".venv" / "bin" / "python")})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "the container answered:" in out and "HEALTHCHECK: healthy" in out, out[-2000:]
    assert "exit status 0" in out or "exit status 143" in out, out[-2000:]
