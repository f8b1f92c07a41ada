#!/usr/bin/env bash
# Colab, simulated: a venv with Colab's packages at Colab's versions (colab/colab-packages.txt), then the
# notebooks' first cell run as Colab runs it, and the packages that cell installed or changed, listed.
# Fails when the cell moves one of Colab's core packages (torch, triton, transformers, numpy).
#
#   colab/simulate.sh                         # build, run the install cell, compare `pip freeze`
#   colab/simulate.sh python -m pytest -q --nbval-lax notebooks/01_bytes.ipynb
#                                             # ... then run a command in the clone, as Colab would
#
# What it does not simulate: a GPU (torch runs on the CPU here), Colab's front end and widget manager.
# COLAB_SIM (default /tmp/colab-sim) holds the venv, the clone (content/minikv) and the two freezes;
# COLAB_PYTHON (default python3.13) is the interpreter: Colab's runtime is Python 3.13.15. COLAB_PACKAGES picks
# another list: colab/colab-packages-2026.07.txt is the past runtime 2026.07 (with COLAB_PYTHON=python3.12).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SIM=${COLAB_SIM:-/tmp/colab-sim}
PY=${COLAB_PYTHON:-python3.13}
PACKAGES=$(realpath "${COLAB_PACKAGES:-$REPO/colab/colab-packages.txt}")
CORE="torch triton transformers numpy"

rm -rf "$SIM" && mkdir -p "$SIM/content"
"$PY" -m venv "$SIM/venv"
export PATH="$SIM/venv/bin:$PATH"  # the cell's `pip` is this venv's, as Colab's is its own
python -m pip install -q pip==24.1.2  # Colab's pip
# Colab's packages as they are (no resolver moves them), then torch's own CUDA libraries.
pip install -q --no-deps -r "$PACKAGES"
pip install -q torch==2.11.0
pip freeze > "$SIM/freeze-before.txt"

# What `git clone https://github.com/minikv-course/minikv` would fetch: this working tree, committed or not.
mkdir "$SIM/origin"
(cd "$REPO" && git ls-files -co --exclude-standard -z |
    while IFS= read -r -d '' f; do if [ -e "$f" ]; then cp --parents "$f" "$SIM/origin"; fi; done)
git -C "$SIM/origin" init -q
git -C "$SIM/origin" add -A
git -C "$SIM/origin" -c user.name=sim -c user.email=sim@localhost commit -q -m "working tree"

# The first code cell of lesson 01, as written, in /content, with google.colab imported; only the clone's
# URL and /content are pointed at this simulation's folders.
(cd "$SIM/content" && python - "$REPO/notebooks/01_bytes.ipynb" "$SIM" <<'EOF'
import json, sys, types
nb, sim = sys.argv[1], sys.argv[2]
cell = next(c for c in json.load(open(nb))["cells"] if c["cell_type"] == "code")
src = "".join(cell["source"])
assert "https://github.com/minikv-course/minikv" in src and "/content/minikv" in src, src
src = src.replace("https://github.com/minikv-course/minikv", f"file://{sim}/origin")
src = src.replace("/content/minikv", f"{sim}/content/minikv")
sys.modules["google.colab"] = types.ModuleType("google.colab")
print("running the install cell:\n" + src)
exec(compile(src, "cell-1", "exec"), {"__name__": "__main__"})
EOF
)
pip freeze | grep -v "^-e \|^minikv @" > "$SIM/freeze-after.txt" || true

verdict=0
python - "$SIM" "$CORE" <<'EOF' || verdict=$?
import re, sys
sim, core = sys.argv[1], sys.argv[2].split()
def read(path):
    out = {}
    for line in open(path):
        if "==" in line:
            name, ver = line.strip().split("==", 1)
            out[re.sub(r"[-_.]+", "-", name).lower()] = ver
    return out
before, after = read(f"{sim}/freeze-before.txt"), read(f"{sim}/freeze-after.txt")
added = sorted(set(after) - set(before))
changed = sorted(n for n in set(after) & set(before) if after[n] != before[n])
removed = sorted(set(before) - set(after))
print(f"the install cell added {len(added)} packages: " + ", ".join(f"{n}=={after[n]}" for n in added))
print(f"changed {len(changed)}: " + (", ".join(f"{n} {before[n]} -> {after[n]}" for n in changed) or "none"))
print(f"removed {len(removed)}: " + (", ".join(removed) or "none"))
moved = [n for n in core if before.get(n) != after.get(n)]
if moved:
    sys.exit(f"FAIL: the install cell moved Colab's {', '.join(moved)}")
print("Colab's " + ", ".join(f"{n}=={after[n]}" for n in core) + ": untouched")
EOF

if [ $# -gt 0 ]; then
    # nbval and pytest-xdist are not Colab's and the cell does not install them: the check needs them.
    pip install -q nbval pytest-xdist
    (cd "$SIM/content/minikv" && "$@")
fi
exit $verdict
