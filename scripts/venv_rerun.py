"""Makes a Python package importable for the calling check script: if it does not import, a
virtual environment is created (or reused), the package pip-installed into it, and the script
re-run there with the same arguments. Imported by the scripts of this folder, not run."""

import os
import subprocess
import sys
import tempfile

# Set in the re-run's environment, so that a package still missing there stops the script
# instead of re-running it for ever.
IN_VENV = "GDSLLM_SCRIPT_IN_VENV"


def ensure_importable(module, requirement, venv=None):
    """Returns when `module` imports; otherwise pip-installs `requirement` into the virtual
    environment at `venv` (a new temporary directory when None) and replaces this process with
    the calling script run there (never returns)."""
    try:
        __import__(module)
        return
    except ImportError:
        pass
    if os.environ.get(IN_VENV) == "1":
        sys.exit(f"{module} is still not importable inside the virtual environment")
    venv = venv or tempfile.mkdtemp(prefix=f"gdsllm-{module}-venv-")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"creating virtual environment {venv}", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "venv", venv])
    print(f"pip install {requirement}", file=sys.stderr)
    subprocess.check_call([python, "-m", "pip", "install", "--quiet", requirement],
                          stdout=sys.stderr)
    script = os.path.abspath(sys.argv[0])
    os.execve(python, [python, script, *sys.argv[1:]], dict(os.environ, **{IN_VENV: "1"}))
