#!/usr/bin/python3
"""The layers of meshtrain and what each may include (docs/architecture.md).

    scripts/check_layers.py            exit 1, naming file:line, for every include that runs backwards
    scripts/check_layers.py --dot      the layer graph as Graphviz text (what includes what, with counts)
    scripts/check_layers.py --lines    lines and headers per folder (a Markdown table)
    scripts/check_layers.py --mermaid  the library's layers as a Mermaid flowchart
    scripts/check_layers.py --mermaid --doc docs/architecture.md   rewrites the graph there

The build runs the check before it compiles the library (src/CMakeLists.txt),
so an include that runs backwards fails the build instead of waiting for a
review. A folder is a layer: src/<layer>/ and include/meshtrain/<layer>.h; the
tools (tools/, app/) may include any layer and no layer includes them; the
examples (examples/) include the library's layers only, as a user's program.
"""
import collections, os, re, sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

# Each layer and the layers it may include (besides itself). Bottom up.
ALLOWED = {
    "util": [],
    "nn": ["util"],                           # attention, rotary, norms: math on tensors, no communication
    "comm": ["util"],
    "mesh": ["comm", "util"],
    "dp": ["mesh", "comm", "util"],
    "tp": ["mesh", "comm", "util", "nn"],
    "cp": ["mesh", "comm", "util", "nn"],
    "ep": ["mesh", "comm", "util", "nn"],   # spreads nn::ExpertParallel modules
    "data": ["comm", "util"],
    "zero": ["dp", "mesh", "comm", "util"],
    "pp": ["dp", "mesh", "comm", "util"],
    "models": ["nn", "util"],                 # plain modules: every axis is applied from outside
    "io": ["models", "nn", "util"],
    "plan": ["models", "pp", "nn", "util"],
    "train": ["io", "plan", "models", "nn", "zero", "pp", "dp", "tp", "cp", "ep", "data", "mesh", "comm", "util"],
}
# A user's program: the examples use the library alone, never the tools' code.
ALLOWED["examples"] = sorted(ALLOWED)
TOOLS = {"app", "tools", "launch"}  # the command-line programs and the launcher: above every layer

INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')
# Each layer's public API is one header, include/meshtrain/<layer>.h; the
# models layer has two (MoE apart); meshtrain.h includes them all.
PUBLIC_HEADER_LAYER = {"moe": "models"}


def layer_of_public_header(name):
    """The layer of include/meshtrain/<name>, or None for the umbrella and version.h."""
    stem = name[:-2] if name.endswith(".h") else name
    stem = PUBLIC_HEADER_LAYER.get(stem, stem)
    return stem if stem in ALLOWED else None


def layer_of_file(rel):
    parts = rel.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return parts[1]
    if parts[0] == "include" and len(parts) == 3 and parts[1] == "meshtrain":
        return layer_of_public_header(parts[2])
    if parts[0] in ("app", "tools", "examples"):
        return parts[0]
    return None


def layer_of_include(include, including_layer):
    parts = include.split("/")
    if parts[0] == "meshtrain" and len(parts) == 2:
        return layer_of_public_header(parts[1]) or including_layer
    if len(parts) > 1 and (parts[0] in ALLOWED or parts[0] in TOOLS):
        return parts[0]  # an internal header by its path under src/ ("comm/backend.h")
    return including_layer  # a header beside the file ("process.h")


def edges():
    """(from layer, to layer) -> [(file, line, include)] for every include between two layers."""
    found = collections.defaultdict(list)
    for top in ("src", "include", "tools", "app", "examples"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in sorted(names):
                if not name.endswith((".h", ".cpp", ".hpp")):
                    continue
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                a = layer_of_file(rel)
                if a is None:
                    continue
                for number, line in enumerate(open(path, errors="replace"), 1):
                    m = INCLUDE.match(line)
                    if m:
                        b = layer_of_include(m.group(1), a)
                        if b != a:
                            found[(a, b)].append((rel, number, m.group(1)))
    return found


def backward(found):
    bad = []
    for (a, b), where in sorted(found.items()):
        if a in TOOLS:
            continue
        if a not in ALLOWED:
            bad += [(f, n, inc, f"'{a}' is not a layer of scripts/check_layers.py") for f, n, inc in where]
        elif b not in ALLOWED[a]:
            why = (f"layer {a} includes {b}" + (", a tool" if b in TOOLS else "") +
                   f"; {a} may include only: {', '.join(ALLOWED[a]) or 'nothing'}")
            bad += [(f, n, inc, why) for f, n, inc in where]
    return bad


def mermaid(counts):
    """The library's layers as a Mermaid flowchart, bottom up (the tools and examples sit above all of them)."""
    lines = ["flowchart BT"]
    for (a, b), n in sorted(counts.items()):
        if a in ALLOWED and a != "examples" and b in ALLOWED:
            lines.append(f"  {a} -->|{n}| {b}")
    return "\n".join(lines)


def write_doc(path, text):
    """Replaces the graph between the layer-graph markers of `path` (docs/architecture.md)."""
    begin, end = "<!-- layer-graph:begin -->", "<!-- layer-graph:end -->"
    doc = open(path).read()
    head, rest = doc.split(begin)
    _, tail = rest.split(end)
    open(path, "w").write(head + begin + "\n```mermaid\n" + text + "\n```\n" + end + tail)


def count_lines():
    """Lines and headers per folder, as a Markdown table (docs/architecture.md)."""
    def lines(paths):
        return sum(sum(1 for _ in open(p, errors="replace")) for p in paths)

    def files(top):
        out = []
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(folder, n) for n in names if n.endswith((".h", ".cpp", ".hpp"))]
        return out

    rows = ["| folder | lines | public headers (lines) | internal headers |", "|---|---:|---:|---:|"]
    total = [0, 0, 0, 0]
    for layer in [l for l in ALLOWED if l != "examples"]:
        src = files(os.path.join("src", layer))
        pub_dir = os.path.join(ROOT, "include", "meshtrain")
        pub = [os.path.join(pub_dir, n) for n in sorted(os.listdir(pub_dir)) if layer_of_public_header(n) == layer]
        internal = [p for p in src if p.endswith(".h")]
        n = lines(src) + lines(pub)
        rows.append(f"| {layer} | {n:,} | {len(pub)} ({lines(pub):,}) | {len(internal)} |")
        for i, v in enumerate((n, len(pub), lines(pub), len(internal))):
            total[i] += v
    rows.append(f"| **library** | **{total[0]:,}** | **{total[1]} ({total[2]:,})** | **{total[3]}** |")
    for top in ("app", "tools"):
        rows.append(f"| {top} | {lines(files(top)):,} | - | - |")
    return "\n".join(rows)


def main():
    if "--lines" in sys.argv:
        print(count_lines())
        return 0
    found = edges()
    if "--dot" in sys.argv or "--mermaid" in sys.argv:
        counts = {k: len(v) for k, v in found.items()}
        if "--dot" in sys.argv:
            print("digraph layers {\n  rankdir=BT;")
            for (a, b), n in sorted(counts.items()):
                print(f'  "{a}" -> "{b}" [label="{n}"];')
            print("}")
        else:
            text = mermaid(counts)
            if "--doc" in sys.argv:
                write_doc(sys.argv[sys.argv.index("--doc") + 1], text)
            else:
                print(text)
        return 0
    bad = backward(found)
    for f, n, inc, why in bad:
        print(f"{f}:{n}: #include \"{inc}\": {why}", file=sys.stderr)
    if bad:
        print(f"check_layers: {len(bad)} include(s) run backwards; move the code to the layer it belongs to, "
              "or change ALLOWED in scripts/check_layers.py with the reason", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
