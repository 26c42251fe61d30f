# Sourced by scripts/setup.sh and scripts/setup_<library>.sh: a venv and what installs into it.

# venv_is_current VENV PACKAGES: its stamp records exactly these packages (then there is nothing to do).
venv_is_current() {
    [ -f "$1/stamp" ] && [ "$(cat "$1/stamp")" = "$2" ]
}

# new_venv VENV: an empty venv in its place (pip in it, as `python -m venv` makes it), on Python 3.11 when
# there is one.
new_venv() {
    local python=${PYTHON:-python3.11}
    command -v "$python" >/dev/null || python=python3
    rm -rf "$1"
    "$python" -m venv "$1"
}

# venv_install VENV PIP_INSTALL_ARGUMENTS...: `pip install` into VENV, by uv (scripts/setup.sh installs it in .venv):
# parallel downloads, and one cache hard-linked into every venv instead of each unpacking torch again. It takes
# what pip would (scripts/uv_options.py: pip's indexes, find-links and constraints here).
venv_install() {
    local venv=$1 uv=${UV:-.venv/bin/uv} options
    shift
    [ -x "$uv" ] || { echo "$uv missing: run scripts/setup.sh (it installs uv)" >&2; return 1; }
    mapfile -t options < <("$venv/bin/python" scripts/uv_options.py)
    "$uv" pip install --quiet --python "$venv/bin/python" "${options[@]}" "$@"
}
