# Sourced by scripts/setup_<library>.sh: a library's own venv for the test fixtures it writes itself.

# venv_is_current VENV PACKAGES: its stamp records exactly these packages (then there is nothing to do).
venv_is_current() {
    [ -f "$1/stamp" ] && [ "$(cat "$1/stamp")" = "$2" ]
}

# new_venv VENV: an empty venv in its place, on Python 3.11 when there is one.
new_venv() {
    local python=${PYTHON:-python3.11}
    command -v "$python" >/dev/null || python=python3
    rm -rf "$1"
    "$python" -m venv "$1"
}
