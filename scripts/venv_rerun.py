"""Makes a Python package importable for the calling check script: if it does not import, a
virtual environment is created (or reused), the package pip-installed into it, and the script
re-run there with the same arguments. Imported by the scripts of this folder, not run."""

import fcntl
import os
import subprocess
import sys
import tempfile

# Set in the re-run's environment, so that a package still missing there stops the script
# instead of re-running it for ever.
IN_VENV = "GDSLLM_SCRIPT_IN_VENV"


def ensure_importable(module, requirement, venv=None):
    """Returns when `module` imports (a name, or a list of names that must all import);
    otherwise pip-installs `requirement` (one, or a list) into the virtual environment at
    `venv` (a new temporary directory when None) and replaces this process with the calling
    script run there (never returns)."""
    modules = [module] if isinstance(module, str) else list(module)
    requirements = [requirement] if isinstance(requirement, str) else list(requirement)
    missing = []
    for name in modules:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if not missing:
        return
    module = ", ".join(missing)
    if os.environ.get(IN_VENV) == "1":
        sys.exit(f"{module} is still not importable inside the virtual environment")
    venv = venv or tempfile.mkdtemp(prefix=f"gdsllm-{missing[0]}-venv-")
    python = os.path.join(venv, "bin", "python")
    # Several checks may share one environment and start at once (the tests of one binary run
    # in parallel): one creates it and installs, the others wait for the lock and find the
    # packages there.
    os.makedirs(os.path.dirname(os.path.abspath(venv)), exist_ok=True)
    with open(os.path.abspath(venv) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(python):
            print(f"creating virtual environment {venv}", file=sys.stderr)
            subprocess.check_call([sys.executable, "-m", "venv", venv])
        print(f"pip install {' '.join(requirements)}", file=sys.stderr)
        subprocess.check_call([python, "-m", "pip", "install", "--quiet", *requirements],
                              stdout=sys.stderr)
    script = os.path.abspath(sys.argv[0])
    os.execve(python, [python, script, *sys.argv[1:]], dict(os.environ, **{IN_VENV: "1"}))
