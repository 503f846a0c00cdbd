# shellcheck shell=bash disable=SC2154  # its variables are test-packages.sh's
# Part of scripts/ship/test-packages.sh (sourced from lib/test-deb.sh while the installed refitd
# serves $sock): the Python client pip-installed into a fresh venv, used from outside the
# checkout.

venv="$work/venv"
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install --no-build-isolation --no-index --no-cache-dir --quiet \
  "$root/client/python" > "$work/pip.log" 2>&1 ||
  { cat "$work/pip.log" >&2; fail "pip install ./client/python"; }
same "pip's version of refit" "$("$venv/bin/pip" show refit | sed -n 's/^Version: //p')" \
  "$pyversion"
# From an empty directory with no PYTHONPATH: the installed copy, not the checkout.
mkdir "$work/elsewhere"
pip_rc=0
(cd "$work/elsewhere" &&
  env -u PYTHONPATH "$venv/bin/python" - "$venv" "$pyversion" "$sock" "$version") <<'PY' || pip_rc=$?
import sys
venv, pyversion, sock, version = sys.argv[1:5]
import refit
assert refit.__file__.startswith(venv + "/"), refit.__file__
assert refit.__version__ == pyversion, (refit.__version__, pyversion)
from refit.v1 import refit_pb2_grpc  # the generated stubs are installed
status = refit.Client(socket=sock).status()
assert status.version == version and status.node, status
print("test-packages: ok: import refit", refit.__version__, "from", refit.__file__)
PY
[ "$pip_rc" -eq 0 ] || fail "import refit from the venv, and a Status round trip"
