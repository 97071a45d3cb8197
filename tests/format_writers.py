"""Write one dataset (scipy CSR label and feature matrices) in each source format xc reads, for tests
that check the formats against each other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.sparse as sp


def _rows(m: sp.csr_matrix):
    for i in range(m.shape[0]):
        a, b = m.indptr[i], m.indptr[i + 1]
        yield m.indices[a:b], m.data[a:b]


def _num(v) -> str:
    return repr(float(np.float32(v)))  # float32 values survive the text round trip exactly


def write_xc(path: Path, y: sp.csr_matrix, x: sp.csr_matrix) -> None:
    """XC-repository sparse text: header ``N F L``, then ``l1,l2 f:v ...``."""
    lines = [f"{x.shape[0]} {x.shape[1]} {y.shape[1]}"]
    for (ys, _), (xs, xv) in zip(_rows(y), _rows(x)):
        lines.append(",".join(map(str, ys)) + " " + " ".join(f"{f}:{_num(v)}" for f, v in zip(xs, xv)))
    path.write_text("\n".join(lines) + "\n")


def write_libsvm(path: Path, y: sp.csr_matrix, x: sp.csr_matrix, base: int = 1, header: bool = False) -> None:
    """Multi-label libsvm: ``l1,l2 f:v ...`` with ``base``-based feature ids, optionally an ``N F L`` header."""
    lines = [f"{x.shape[0]} {x.shape[1]} {y.shape[1]}"] if header else []
    for (ys, _), (xs, xv) in zip(_rows(y), _rows(x)):
        lines.append(",".join(map(str, ys)) + " " + " ".join(f"{f + base}:{_num(v)}" for f, v in zip(xs, xv)))
    path.write_text("\n".join(lines) + "\n")


def write_arff(path: Path, y: sp.csr_matrix, x: sp.csr_matrix, label_names: list[str], labels_first: bool,
               sparse: bool = True, relation: str = "xc") -> None:
    """A multi-label ARFF file: numeric features ``f0..``, {0,1} labels named ``label_names``, placed
    before or after the features; sparse ``{i v, ...}`` or dense rows."""
    nl, nf = y.shape[1], x.shape[1]
    quote = lambda s: "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"  # noqa: E731
    feat_attrs = [f"@attribute f{j} numeric" for j in range(nf)]
    lab_attrs = [f"@attribute {quote(n)} {{0,1}}" for n in label_names]
    lab_off, feat_off = (0, nl) if labels_first else (nf, 0)
    lines = [f"@relation {quote(relation)}", *(lab_attrs + feat_attrs if labels_first else feat_attrs + lab_attrs),
             "@data"]
    for (ys, _), (xs, xv) in zip(_rows(y), _rows(x)):
        items = sorted([(lab_off + int(lab), "1") for lab in ys]
                       + [(feat_off + int(f), _num(v)) for f, v in zip(xs, xv)])
        if sparse:
            lines.append("{" + ",".join(f"{i} {v}" for i, v in items) + "}")
        else:
            row = ["0"] * (nl + nf)
            for i, v in items:
                row[i] = v
            lines.append(",".join(row))
    path.write_text("\n".join(lines) + "\n")


def write_mulan_xml(path: Path, label_names: list[str]) -> None:
    from xml.sax.saxutils import quoteattr

    body = "".join(f"<label name={quoteattr(n)}></label>\n" for n in label_names)
    path.write_text(f'<?xml version="1.0" encoding="utf-8"?>\n'
                    f'<labels xmlns="http://mulan.sourceforge.net/labels">\n{body}</labels>\n')


def write_all(root: Path, splits: dict[str, tuple[sp.csr_matrix, sp.csr_matrix]]) -> dict[str, Path]:
    """The same data as ``xc_sparse``, MULAN ``arff`` (sparse rows, labels last, XML) and 1-based ``libsvm``
    (no header) directories under ``root``; returns {kind: directory}."""
    num_labels = next(iter(splits.values()))[0].shape[1]
    names = [f"tag {j}, '{j}'" for j in range(num_labels)]  # blanks, commas and quotes in the names
    dirs = {kind: root / kind for kind in ("xc_sparse", "arff", "libsvm")}
    for d in dirs.values():
        d.mkdir(parents=True)
    for split, (y, x) in splits.items():
        write_xc(dirs["xc_sparse"] / f"{split}.txt", y, x)
        write_arff(dirs["arff"] / f"data-{split}.arff", y, x, names, labels_first=False)
        write_libsvm(dirs["libsvm"] / f"data_{split}.svm", y, x)
    write_mulan_xml(dirs["arff"] / "data.xml", names)
    return dirs
