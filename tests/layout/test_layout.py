"""The repository's layout as the README and DEVELOPERS.md state it: dependencies between the
top-level source folders point one way -- kernels <- core <- wire, cli <- server, clients --
so no folder includes one above it, and server/ and clients/ never include each other. Every
C++/CUDA source's `#include "folder/..."` is read; each include against the order fails naming
the file and the include."""

import os
import re
import unittest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# What each top-level folder may include (besides itself).
ALLOWED = {
    "kernels": set(),
    "core": {"kernels"},
    "wire": {"kernels", "core"},
    "cli": {"kernels", "core"},
    "server": {"kernels", "core", "wire", "cli"},
    "clients": {"kernels", "core", "wire", "cli"},
}
INCLUDE = re.compile(r'\s*#\s*include\s+"([^"/]+)/')


class LayoutTest(unittest.TestCase):

    def test_folders_include_only_the_folders_below_them(self):
        wrong = []
        for top, allowed in ALLOWED.items():
            for root, _, files in os.walk(os.path.join(ROOT, top)):
                for f in files:
                    if not f.endswith((".h", ".cc", ".cu", ".cuh")):
                        continue
                    path = os.path.join(root, f)
                    with open(path, errors="replace") as src:
                        for n, line in enumerate(src, 1):
                            m = INCLUDE.match(line)
                            if m and m.group(1) in ALLOWED and m.group(1) != top \
                                    and m.group(1) not in allowed:
                                wrong.append(f"{os.path.relpath(path, ROOT)}:{n}: {line.strip()}")
        self.assertEqual(wrong, [], "includes against kernels <- core <- wire, cli <- server, "
                                    "clients:\n" + "\n".join(wrong))

    def test_the_order_has_no_cycle(self):
        # The allowed graph itself: a folder never reaches back to itself.
        def reach(start, seen):
            for d in ALLOWED[start]:
                if d not in seen:
                    seen.add(d)
                    reach(d, seen)
            return seen
        for top in ALLOWED:
            self.assertNotIn(top, reach(top, set()), top)


CORE_INCLUDE = re.compile(r'\s*#\s*include\s+"core/([^/"]+)/')


class CoreLayoutTest(unittest.TestCase):

    def core_graph(self):
        graph = {}
        core = os.path.join(ROOT, "core")
        for sub in sorted(os.listdir(core)):
            if not os.path.isdir(os.path.join(core, sub)):
                continue
            deps = graph.setdefault(sub, set())
            for root, _, files in os.walk(os.path.join(core, sub)):
                for f in files:
                    if not f.endswith((".h", ".cc", ".cu", ".cuh")):
                        continue
                    with open(os.path.join(root, f), errors="replace") as src:
                        for line in src:
                            m = CORE_INCLUDE.match(line)
                            if m and m.group(1) != sub:
                                deps.add(m.group(1))
        return graph

    def test_the_transport_contract_stands_below_the_publication(self):
        # A bucket's road reads engine -> gpu -> transport -> rollout -> nccl: the transport
        # contract includes nothing of the publication, the rollout engines or NCCL.
        graph = self.core_graph()
        self.assertEqual(graph["transport"] & {"engine", "gpu", "rollout", "nccl", "group"}, set())
        self.assertNotIn("rollout", graph["nccl"])

    def test_core_folders_include_each_other_without_a_cycle(self):
        graph = self.core_graph()
        cycles = set()
        for a in graph:
            for b in graph[a]:
                # a -> b and b reaches a
                seen, todo = set(), [b]
                while todo:
                    n = todo.pop()
                    if n in seen or n not in graph:
                        continue
                    seen.add(n)
                    todo.extend(graph[n])
                if a in seen:
                    cycles.add(frozenset({a, b}))
        self.assertEqual(cycles, set(),
                         "core folders that include each other: " +
                         ", ".join(" <-> ".join(sorted(c)) for c in cycles))


if __name__ == "__main__":
    unittest.main()
