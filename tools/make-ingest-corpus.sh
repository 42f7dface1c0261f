#!/usr/bin/env bash
# Makes the document-ingest test corpus under tests/ingest/ (committed, so CI never needs these
# tools):
#
#   tests/ingest/src/report.md   the one Markdown source of report.* (hand-written, committed)
#   tests/ingest/good/           one real file per format, made by real producers:
#                                  pandoc        report.docx/.epub/.html, market_records.docx,
#                                                the_diary_of_greta.epub, field_notes.html
#                                  LibreOffice   report.odt/.pdf/.rtf (headless, from report.docx),
#                                                field_notes.pdf (from a pandoc docx)
#                                  poppler+img2pdf  scanned.pdf (page 1 of report.pdf as an image)
#                                  Python stdlib only where no producer exists: notebook.ipynb
#                                  (json), letter.eml (email), inbox.mbox (mailbox), table.csv/.tsv
#                                  (csv), data.json (json), the encoded .txt files (codecs)
#   tests/ingest/bad/            files broken in one specific way each: qpdf (encrypted.pdf),
#                                byte surgery on report.pdf/report.epub, zipfile (bomb.docx),
#                                heredocs and fixed-seed random bytes for the rest
#   tests/ingest/README.md       the manifest: every file, its producer and version, the facts,
#                                headings, pages and chapters to expect, what is wrong with each
#                                bad file, and `pdftotext -layout` of every page of the PDFs
#   tests/ingest/.gitattributes  "* -text": git keeps the CRLF, UTF-16 and binary bytes as made
#
# The samples' rich copies (field_notes, market_records, the_diary_of_greta) keep the words of
# assets/samples/*.txt exactly (the demo model knows ~900 words); the only words added are one
# heading per page/chapter, made of words already in that sample.
#
# Needs (Debian 12, as root):
#   apt-get install -y --no-install-recommends libreoffice-writer pandoc qpdf poppler-utils \
#     img2pdf unzip python3 fonts-dejavu-core
#
# Usage: tools/make-ingest-corpus.sh     (rerunnable: wipes and rewrites tests/ingest/{good,bad}
# and README.md; pandoc's outputs are stamped with SOURCE_DATE_EPOCH; LibreOffice's PDFs still
# carry a fresh /ID and creation date, so rerunning changes their bytes, not their content)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

for tool in soffice pandoc qpdf pdftotext pdftoppm pdfinfo img2pdf unzip python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool: see the header of $0" >&2; exit 1; }
done

root=tests/ingest
src=$root/src
good=$root/good
bad=$root/bad
samples=assets/samples
export SOURCE_DATE_EPOCH=1735689600 # 2025-01-01T00:00:00Z
export TZ=UTC LC_ALL=C.UTF-8
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() { echo "make-ingest-corpus: $*" >&2; exit 1; }
# (pipes end in readers that drain their input: under pipefail, grep -q or head would SIGPIPE the writer)
# LibreOffice headless with a throwaway profile (no clash with a running soffice, no user settings)
lo() { # lo FORMAT OUTDIR INPUT
  soffice -env:UserInstallation="file://$work/lo-profile" --headless \
    --convert-to "$1" --outdir "$2" "$3" >"$work/lo.log" 2>&1 || { cat "$work/lo.log" >&2; fail "soffice $1 $3"; }
  [[ -s "$2/$(basename "${3%.*}").${1%%:*}" ]] || { cat "$work/lo.log" >&2; fail "soffice made no $1 from $3"; }
}
page_text() { pdftotext -f "$2" -l "$2" "$1" -; } # page_text PDF N
expect_on_page() { # expect_on_page PDF N TEXT
  page_text "$1" "$2" | tr '\n' ' ' | grep -F "$3" >/dev/null || fail "$1: '$3' not on page $2"
}
expect_not_on_page() {
  ! page_text "$1" "$2" | tr '\n' ' ' | grep -F "$3" >/dev/null || fail "$1: '$3' unexpectedly on page $2"
}
PAGEBREAK='```{=openxml}
<w:p><w:r><w:br w:type="page"/></w:r></w:p>
```'

rm -rf "$good" "$bad"
mkdir -p "$good" "$bad"
[[ -f $src/report.md ]] || fail "missing $src/report.md"

# ---------------------------------------------------------------------------------------------
# good/report.* from src/report.md
# ---------------------------------------------------------------------------------------------
pandoc -f markdown -t docx "$src/report.md" -o "$good/report.docx"
for fmt in pdf odt rtf; do lo "$fmt" "$good" "$good/report.docx"; done
# EPUB: the level-1 title becomes the book title (title page), each level-2 section a chapter
pandoc -f markdown -t epub3 "$src/report.md" --shift-heading-level-by=-1 --epub-chapter-level=1 \
  -M lang=en -M identifier=urn:uuid:6f1c2a44-0000-4000-8000-00000000f001 -o "$good/report.epub"
pandoc -f markdown -t html5 --standalone -M pagetitle="Quarterly Report" -M lang=en \
  "$src/report.md" -o "$work/report.html"
# boilerplate the extractor must drop: a menu right after <body>, a script and a style before </body>
python3 - "$work/report.html" "$good/report.html" <<'PY'
import sys
html = open(sys.argv[1], encoding="utf-8").read()
nav = ('<nav class="site-menu"><a href="/">Home</a> <a href="/about">About</a> '
       '<a href="/contact">Contact</a></nav>\n')
tail = ('<script>\nvar tracking = 1;\n</script>\n'
        '<style>\n.site-menu { display: flex; gap: 1em; }\n</style>\n')
assert html.count("<body>") == 1 and html.count("</body>") == 1
html = html.replace("<body>\n", "<body>\n" + nav).replace("</body>", tail + "</body>")
open(sys.argv[2], "w", encoding="utf-8").write(html)
PY

expect_on_page "$good/report.pdf" 1 "Quarterly Report"
expect_on_page "$good/report.pdf" 1 "Summary"
expect_on_page "$good/report.pdf" 2 "Regional Figures"
expect_on_page "$good/report.pdf" 2 "North grew by 12 percent"
expect_on_page "$good/report.pdf" 2 "3900"
expect_on_page "$good/report.pdf" 3 "Outlook"
expect_on_page "$good/report.pdf" 3 "the archive"
expect_not_on_page "$good/report.pdf" 1 "Regional Figures"
[[ $(pdfinfo "$good/report.pdf" | awk '/^Pages:/{print $2}') == 3 ]] || fail "report.pdf is not 3 pages"

# ---------------------------------------------------------------------------------------------
# good/ samples in rich formats (words exactly as in assets/samples/*.txt + one heading a page)
# ---------------------------------------------------------------------------------------------
python3 - "$samples" "$work" "$PAGEBREAK" <<'PY'
import sys, re
samples, work, pagebreak = sys.argv[1:4]
def paras(name):
    text = open(f"{samples}/{name}.txt", encoding="utf-8").read()
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]

# field_notes: page 1 = everything before the amber falcon paragraph, page 2 = the rest
fn = paras("field_notes")
cut = next(i for i, p in enumerate(fn) if "secret code of amber falcon" in p)
out = ["# In the Morning", *fn[:cut], pagebreak, "# After the Storm", *fn[cut:]]
open(f"{work}/field_notes.md", "w").write("\n\n".join(out) + "\n")
open(f"{work}/field_notes-html.md", "w").write(
    "\n\n".join(p for p in out if p != pagebreak) + "\n")

# market_records: one paragraph per line of the .txt
mr = [l.strip() for l in open(f"{samples}/market_records.txt", encoding="utf-8") if l.strip()]
open(f"{work}/market_records.md", "w").write("\n\n".join(["# Market Report", *mr]) + "\n")

# the_diary_of_greta: one chapter per day; a day's following fact paragraphs stay with it
dg = paras("the_diary_of_greta")
out = []
for p in dg:
    m = re.match(r"On (monday|tuesday|wednesday|thursday|friday),", p)
    if m:
        out.append("# " + m.group(1).capitalize())
    out.append(p)
assert out[0].startswith("# "), "diary must start with a day"
open(f"{work}/the_diary_of_greta.md", "w").write("\n\n".join(out) + "\n")
PY
pandoc -f markdown-smart -t docx "$work/field_notes.md" -o "$work/field_notes.docx"
lo pdf "$good" "$work/field_notes.docx"
pandoc -f markdown-smart -t html5 --standalone -M pagetitle="In the Morning" -M lang=en \
  "$work/field_notes-html.md" -o "$good/field_notes.html"
pandoc -f markdown-smart -t docx "$work/market_records.md" -o "$good/market_records.docx"
pandoc -f markdown-smart -t epub3 --epub-chapter-level=1 -M title=Greta -M lang=en \
  -M identifier=urn:uuid:6f1c2a44-0000-4000-8000-00000000f002 \
  "$work/the_diary_of_greta.md" -o "$good/the_diary_of_greta.epub"

[[ $(pdfinfo "$good/field_notes.pdf" | awk '/^Pages:/{print $2}') == 2 ]] || fail "field_notes.pdf is not 2 pages"
expect_on_page "$good/field_notes.pdf" 1 "In the morning, Anna walked along the river."
expect_on_page "$good/field_notes.pdf" 1 "Nobody opened the gate at night."
expect_on_page "$good/field_notes.pdf" 2 "The secret code of amber falcon is 48152."
expect_on_page "$good/field_notes.pdf" 2 "The room number of silver otter is 30719."
expect_not_on_page "$good/field_notes.pdf" 1 "amber falcon"

# ---------------------------------------------------------------------------------------------
# good/ notebook, e-mail, tables, JSON, encodings (Python stdlib: no other producer)
# ---------------------------------------------------------------------------------------------
printf 'Budget for the next quarter: 8100 coins.\n' >"$work/budget.txt"
lo pdf "$work" "$work/budget.txt"
python3 - "$good" "$work/budget.pdf" <<'PY'
import sys, json, csv, io, mailbox, time
from email.message import EmailMessage
from email import policy
good, budget_pdf = sys.argv[1:3]

# notebook.ipynb (nbformat 4.5: cell ids)
nb = {
    "cells": [
        {"cell_type": "markdown", "id": "a1b2c3d4", "metadata": {}, "source": ["# Analysis"]},
        {"cell_type": "code", "execution_count": 1, "id": "b2c3d4e5", "metadata": {},
         "outputs": [{"name": "stdout", "output_type": "stream", "text": ["6\n"]}],
         "source": ["print(sum([1, 2, 3]))"]},
        {"cell_type": "markdown", "id": "c3d4e5f6", "metadata": {}, "source": ["The total is six."]},
    ],
    "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python", "version": "3.11.2"},
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}
with open(f"{good}/notebook.ipynb", "w", encoding="utf-8") as f:
    json.dump(nb, f, indent=1, ensure_ascii=False)
    f.write("\n")

# letter.eml: multipart/mixed [ multipart/alternative [text/plain, text/html], application/pdf ]
msg = EmailMessage()
msg["From"] = "Alice Example <alice@example.org>"
msg["To"] = "Bob Example <bob@example.org>"
msg["Subject"] = "Budget meeting"
msg["Date"] = "Tue, 14 Jan 2025 09:30:00 +0000"
msg["Message-ID"] = "<budget-meeting-1@example.org>"
msg.set_content("The budget meeting moves to Thursday.\n")
msg.add_alternative("<html><body><p>The budget meeting moves to <b>Thursday</b>.</p></body></html>\n",
                    subtype="html")
msg.add_attachment(open(budget_pdf, "rb").read(), maintype="application", subtype="pdf",
                   filename="budget.pdf")
for n, part in enumerate(p for p in msg.walk() if p.is_multipart()):
    part.set_boundary(f"==folio-boundary-{n}==")
with open(f"{good}/letter.eml", "wb") as f:  # RFC 5322: CRLF line ends
    f.write(msg.as_bytes(policy=policy.SMTP))

# inbox.mbox: two messages; the second's body has a line starting "From " (escaped ">From ")
box = mailbox.mbox(f"{good}/inbox.mbox", create=True)
for subject, date, body, t in [
    ("First note", "Mon, 13 Jan 2025 08:00:00 +0000", "The first note is short.\n", 1736755200),
    ("Second note", "Mon, 13 Jan 2025 17:45:00 +0000",
     "The second note follows the first.\nFrom the desk of Alice, with thanks.\n", 1736790300),
]:
    m = EmailMessage()
    m["From"] = "Alice Example <alice@example.org>"
    m["To"] = "Bob Example <bob@example.org>"
    m["Subject"] = subject
    m["Date"] = date
    m["Message-ID"] = f"<{subject.lower().replace(' ', '-')}@example.org>"
    m.set_content(body)
    mm = mailbox.mboxMessage(m)
    mm.set_from("alice@example.org", time.gmtime(t))
    box.add(mm)
box.flush()
box.close()

# table.csv / table.tsv: header + 3 rows, 3 columns; one field holds a comma (quoted in CSV)
rows = [["City", "Population", "Note"],
        ["Oslo", "709000", "Capital, largest city"],
        ["Bergen", "286000", "Rainy"],
        ["Tromso", "77000", "Arctic"]]
buf = io.StringIO()
csv.writer(buf).writerows(rows)  # RFC 4180: CRLF, minimal quoting
open(f"{good}/table.csv", "w", newline="").write(buf.getvalue())
buf = io.StringIO()
csv.writer(buf, delimiter="\t", lineterminator="\n", quoting=csv.QUOTE_MINIMAL).writerows(rows)
open(f"{good}/table.tsv", "w", newline="").write(buf.getvalue())

# data.json: three levels of nesting with an array
data = {"library": {"name": "Harbor Library",
                    "address": {"street": "Pier Road 4", "city": "Bergen"},
                    "shelves": [{"id": 1, "topic": "maps", "books": 42},
                                {"id": 2, "topic": "ships", "books": 17}],
                    "open": True}}
with open(f"{good}/data.json", "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2)
    f.write("\n")

# encodings
latin = "Café crème brûlée — naïve façade\nThe menu changes every week.\nAsk the waiter for today's dishes.\n"
open(f"{good}/latin1.txt", "wb").write(latin.encode("cp1252"))
utf16 = "The harbor opens at six.\nThe ferry to the café leaves at seven.\nTickets are sold on board.\n"
open(f"{good}/utf16le-bom.txt", "wb").write(b"\xff\xfe" + utf16.encode("utf-16-le"))
open(f"{good}/utf16be-bom.txt", "wb").write(b"\xfe\xff" + utf16.encode("utf-16-be"))
PY
LC_ALL=C grep -q $'\x97' "$good/latin1.txt" || fail "latin1.txt: no 0x97 em dash"

# scanned.pdf: page 1 of report.pdf rendered to a grey PNG, wrapped as an image-only PDF
pdftoppm -r 150 -gray -png -f 1 -l 1 "$good/report.pdf" "$work/scan"
img2pdf --pagesize Letter -o "$good/scanned.pdf" "$work"/scan*.png
[[ -z $(pdftotext "$good/scanned.pdf" - | tr -d ' \n\f') ]] || fail "scanned.pdf has a text layer"

# ---------------------------------------------------------------------------------------------
# bad/
# ---------------------------------------------------------------------------------------------
qpdf --encrypt user owner 256 -- "$good/report.pdf" "$bad/encrypted.pdf"
! pdftotext "$bad/encrypted.pdf" - >/dev/null 2>&1 || fail "encrypted.pdf opens without a password"
pdftotext -upw user "$bad/encrypted.pdf" - | grep "Regional Figures" >/dev/null || fail "encrypted.pdf: user password fails"

size=$(stat -c %s "$good/report.pdf")
head -c $((size * 40 / 100)) "$good/report.pdf" >"$bad/truncated.pdf"

python3 - "$good/report.pdf" "$bad/broken-xref.pdf" "$good/report.epub" "$bad/missing-spine.epub" \
  "$bad/bomb.docx" "$bad" <<'PY'
import sys, re, zipfile, random
pdf_in, pdf_out, epub_in, epub_out, bomb, bad = sys.argv[1:7]

# broken-xref.pdf: wrong startxref offset (same digit count) + garbled xref entries (same length)
data = bytearray(open(pdf_in, "rb").read())
m = list(re.finditer(rb"startxref\r?\n(\d+)", bytes(data)))[-1]
off = int(m.group(1))
assert data[off:off + 4] == b"xref", "report.pdf has no classic xref table at startxref"
wrong = str(off // 3).rjust(len(m.group(1)), "0").encode()
assert len(wrong) == len(m.group(1)) and int(wrong) != off
data[m.start(1):m.end(1)] = wrong
t = data.index(b"trailer", off)
first_entry = data.index(b"\n", off + 5) + 1  # after "xref\n0 N\n"
for i in range(first_entry, t):
    if data[i] not in b"\r\n":
        data[i] = ord("?")
open(pdf_out, "wb").write(data)
print(f"broken-xref.pdf: startxref {off} -> {wrong.decode()}, xref bytes {first_entry}..{t} garbled",
      file=open(f"{bad}/.notes", "a"))

# missing-spine.epub: drop the "Regional Figures" chapter file, keep it in the OPF manifest/spine
victim = "EPUB/text/ch002.xhtml"
with zipfile.ZipFile(epub_in) as zin, zipfile.ZipFile(epub_out, "w") as zout:
    names = zin.namelist()
    assert names[0] == "mimetype" and victim in names
    assert b"Regional Figures" in zin.read(victim)
    for info in zin.infolist():
        if info.filename != victim:
            zout.writestr(info, zin.read(info.filename), compress_type=info.compress_type)

# bomb.docx: word/document.xml is 1 GiB of 'A' inside one <w:t>, deflated at level 9
ct = ('<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
      '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
      '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
      '<Default Extension="xml" ContentType="application/xml"/>'
      '<Override PartName="/word/document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document.main+xml"/>'
      '</Types>')
rels = ('<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
        '<Relationships xmlns="http://schemas.openxmlformats.org/package/2006/relationships">'
        '<Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" Target="word/document.xml"/>'
        '</Relationships>')
head = (b'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>\n'
        b'<w:document xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main">'
        b'<w:body><w:p><w:r><w:t>')
tail = b'</w:t></w:r></w:p></w:body></w:document>'
stamp = (2025, 1, 1, 0, 0, 0)
with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for name, body in [("[Content_Types].xml", ct), ("_rels/.rels", rels)]:
        zi = zipfile.ZipInfo(name, stamp); zi.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(zi, body, compresslevel=9)
    zi = zipfile.ZipInfo("word/document.xml", stamp); zi.compress_type = zipfile.ZIP_DEFLATED
    # 3.11/3.12 read the private slot, 3.13 the public one
    setattr(zi, "compress_level" if hasattr(zi, "compress_level") else "_compresslevel", 9)
    chunk = b"A" * (1 << 20)
    with z.open(zi, "w") as w:  # streamed: never holds 1 GiB in memory
        w.write(head)
        for _ in range(1024):
            w.write(chunk)
        w.write(tail)
with zipfile.ZipFile(bomb) as z:
    print(f"bomb.docx: word/document.xml {z.getinfo('word/document.xml').file_size} bytes unpacked",
          file=open(f"{bad}/.notes", "a"))
PY
[[ $(stat -c %s "$bad/bomb.docx") -lt 2000000 ]] || fail "bomb.docx is not < 2 MB"

cat >"$bad/entities.xml" <<'EOF'
<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE lolz [
  <!ENTITY lol "lol">
  <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
  <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
  <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
  <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
  <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
  <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
  <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
  <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
  <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
<lolz>&lol9;</lolz>
EOF

python3 - "$bad" <<'PY'
import sys, random
bad = sys.argv[1]
notes = open(f"{bad}/.notes", "a")

# binary.txt: 4096 fixed-seed random bytes, plus a NUL every 256 bytes
b = bytearray(random.Random(20250101).randbytes(4096))
for i in range(0, 4096, 256):
    b[i] = 0
open(f"{bad}/binary.txt", "wb").write(b)
print(f"binary.txt: 4096 bytes, {b.count(0)} NULs", file=notes)

# invalid-utf8.txt: valid UTF-8 English (one é) with 3 invalid bytes, each its own invalid sequence
parts = [
    "The harbor office keeps a record of every ship that enters the bay. Each entry lists\n"
    "the name of the ship, the cargo and the day it arrived.\n\n".encode(),
    b"In the spring the clerk noticed a gap in the ledger ", b"\xff",
    b" and asked the captain about it.\n\n",
    "The caf".encode(), b"\xc3", "(near the pier) served tea to the sailors while they waited; its owner, Ren\u00e9e, kept the\n"
    "receipts in a tin box.\n\n".encode(),
    b"By autumn the ledger was complete again ", b"\x80", b" and the office closed for the winter.\n",
]
data = b"".join(parts)
open(f"{bad}/invalid-utf8.txt", "wb").write(data)
bad_at = [i for i, x in enumerate(data) if x in (0xFF, 0x80) or (x == 0xC3 and data[i + 1] == 0x28)]
dec = data.decode("utf-8", "replace")
assert dec.count("\ufffd") == 3 and len(bad_at) == 3
print(f"invalid-utf8.txt: {len(data)} bytes, invalid bytes at offsets {bad_at} "
      f"(0xFF; 0xC3 followed by '('; 0x80); lossy decoding gives 3 U+FFFD", file=notes)

# utf16le-nobom.txt: UTF-16LE without a BOM, ASCII-only English
open(f"{bad}/utf16le-nobom.txt", "wb").write(
    "The ferry leaves the harbor at seven.\nTickets are sold on board.\n".encode("utf-16-le"))
open(f"{bad}/empty.txt", "wb").close()
PY

# ---------------------------------------------------------------------------------------------
# checks: sizes, EPUB spines
# ---------------------------------------------------------------------------------------------
total=0
for f in "$good"/* "$bad"/*; do
  s=$(stat -c %s "$f")
  total=$((total + s))
  [[ $f == */bomb.docx || $s -lt 300000 ]] || fail "$f is $s bytes (>= 300 KB)"
done
[[ $total -lt 3000000 ]] || fail "corpus is $total bytes (>= 3 MB)"
spine_files() { unzip -p "$1" EPUB/content.opf | grep -c '<itemref idref="ch'; }
[[ $(spine_files "$good/report.epub") -ge 3 ]] || fail "report.epub has < 3 chapters"
[[ $(spine_files "$good/the_diary_of_greta.epub") -eq 5 ]] || fail "diary epub is not 5 chapters"
unzip -p "$good/the_diary_of_greta.epub" EPUB/text/ch001.xhtml | grep "90417" >/dev/null || fail "pass key not in ch001"
unzip -p "$good/the_diary_of_greta.epub" EPUB/text/ch005.xhtml | grep "violet lynx" >/dev/null || fail "violet lynx not in ch005"
qpdf --check "$bad/broken-xref.pdf" >"$work/xref-check.txt" 2>&1 || true
qpdf --check "$bad/truncated.pdf" >"$work/trunc-check.txt" 2>&1 || true

# ---------------------------------------------------------------------------------------------
# manifest
# ---------------------------------------------------------------------------------------------
v_soffice=$(soffice -env:UserInstallation="file://$work/lo-profile" --version 2>/dev/null | sed -n 1p)
v_pandoc=$(pandoc --version | sed -n 1p)
v_qpdf=$(qpdf --version | sed -n 1p)
v_poppler=$(pdftotext -v 2>&1 | sed -n 1p)
v_img2pdf=$(img2pdf --version 2>&1 | sed -n 1p)
v_python=$(python3 --version)
sz() { stat -c %s "$1"; }
layout() { # layout PDF: pdftotext -layout of every page in fenced blocks
  local n p
  n=$(pdfinfo "$1" | awk '/^Pages:/{print $2}')
  for ((p = 1; p <= n; p++)); do
    printf '\nPage %d:\n\n```text\n' "$p"
    pdftotext -layout -f "$p" -l "$p" "$1" - | sed -e 's/\f//g' -e 's/[[:space:]]*$//' | sed -e '/./,$!d'
    printf '```\n'
  done
}
xref_note=$(grep broken-xref "$bad/.notes")
bomb_note=$(grep bomb.docx "$bad/.notes")
bin_note=$(grep binary.txt "$bad/.notes")
utf8_note=$(grep invalid-utf8 "$bad/.notes")
rm "$bad/.notes"
xref_qpdf=$(grep -m2 -iE 'warning|error' "$work/xref-check.txt" | sed 's/^/    /' || true)
if pdftotext "$bad/broken-xref.pdf" - 2>/dev/null | grep "Regional Figures" >/dev/null; then
  xref_rebuild="poppler rebuilds the xref and reads all 3 pages"
else
  xref_rebuild="poppler does not recover the text"
fi
trunc_qpdf=$(grep -m2 -iE 'warning|error' "$work/trunc-check.txt" | sed 's/^/    /' || true)

cat >"$root/README.md" <<EOF
# Ingest test corpus

Made by \`tools/make-ingest-corpus.sh\` (rerun it to rebuild; it needs LibreOffice, pandoc, qpdf,
poppler-utils and img2pdf, see its header). The files are committed so tests and CI need none of
these tools. Symlink loops, unreadable files, files changing while read and the 50 MB one-line
HTML are made at test time by the Rust tests and are not here.

Producers:

| tool | version |
|------|---------|
| LibreOffice (\`soffice --version\`) | $v_soffice |
| pandoc (\`pandoc --version \| head -1\`) | $v_pandoc |
| qpdf (\`qpdf --version \| head -1\`) | $v_qpdf |
| poppler (\`pdftotext -v\`) | $v_poppler |
| img2pdf | $v_img2pdf |
| Python (stdlib only) | $v_python |

pandoc runs with \`SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH\` (docx/epub metadata dates are 2025-01-01).
LibreOffice converts with \`soffice --headless --convert-to FMT\` and a throwaway profile.

## good/

### report.* (one source: \`src/report.md\`)

Content of every report.*: heading "Quarterly Report" (title); heading "Summary" + one paragraph
("Revenue rose in two of three regions this quarter. ..."); heading "Regional Figures" + a bulleted
list of three items ("North grew by 12 percent", "South held steady", "East fell by 3 percent") +
a table with header \`Region | Revenue | Staff\` and rows \`North | 4200 | 31\`, \`South | 3900 | 28\`;
heading "Outlook" + a paragraph ending in the hyperlink "the archive" → https://example.org/archive.
Headings: "Quarterly Report" is level 1, the other three level 2 (docx: Heading 1 / Heading 2).

| file | bytes | producer | what to expect |
|------|------:|----------|----------------|
| report.docx | $(sz $good/report.docx) | \`pandoc -f markdown -t docx src/report.md\` | two raw \`<w:p><w:r><w:br w:type="page"/></w:r></w:p>\` paragraphs: before "Regional Figures" and before "Outlook"; hyperlink as a \`w:hyperlink\` relationship |
| report.pdf | $(sz $good/report.pdf) | \`soffice --convert-to pdf report.docx\` | 3 pages, Letter. p1: "Quarterly Report", "Summary" + paragraph; p2: "Regional Figures", list, table; p3: "Outlook" + paragraph; link annotation to https://example.org/archive on p3 |
| report.odt | $(sz $good/report.odt) | \`soffice --convert-to odt report.docx\` | same content; each page break became an empty paragraph followed by the heading in an automatic style with \`fo:break-before="page"\` |
| report.rtf | $(sz $good/report.rtf) | \`soffice --convert-to rtf report.docx\` | same content; \`\\page\` breaks; HYPERLINK field |
| report.epub | $(sz $good/report.epub) | \`pandoc -t epub3 --shift-heading-level-by=-1 --epub-chapter-level=1 -M lang=en -M identifier=…\` | EPUB 3. The level-1 heading becomes the book title (dc:title "Quarterly Report", spine item 1 \`text/title_page.xhtml\`); spine then: \`text/ch001.xhtml\` "Summary", \`text/ch002.xhtml\` "Regional Figures" (list + table), \`text/ch003.xhtml\` "Outlook" (link). \`nav.xhtml\` is in the manifest, not the spine |
| report.html | $(sz $good/report.html) | \`pandoc -t html5 --standalone -M pagetitle="Quarterly Report"\`, then edited | \`<title>Quarterly Report</title>\`, pandoc's \`<style>\` in \`<head>\`; boilerplate added to check it is dropped: right after \`<body>\` a \`<nav class="site-menu">\` with links "Home About Contact"; just before \`</body>\` a \`<script>\` holding \`var tracking = 1;\` and a \`<style>\` block |

### Samples (assets/samples/*.txt in rich formats)

Words exactly as in the .txt (pandoc with \`-f markdown-smart\`, so no quote/dash changes); the only
added words are the headings below, made of words of that sample.

| file | bytes | producer | what to expect |
|------|------:|----------|----------------|
| field_notes.pdf | $(sz $good/field_notes.pdf) | pandoc → docx (raw openxml page break) → \`soffice --convert-to pdf\` | 2 pages. **Page 1**: heading "In the Morning", the paragraphs "In the morning, Anna walked along the river. …" and "The weather was foggy … Nobody opened the gate at night." **Page 2**: heading "After the Storm", then "The secret code of amber falcon is 48152." (first line of page 2's body), "After the storm, … Oskar found 12 shells …", "Record 7: Felix, age 41, from the harbor. Record 8: Clara, age 29, from the village.", "It was a windy day …", "The room number of silver otter is 30719.", "The tower in the valley … a tunnel under the forest." (checked with \`pdftotext -f N -l N\`) |
| field_notes.html | $(sz $good/field_notes.html) | \`pandoc -t html5 --standalone -M pagetitle="In the Morning"\` (same source, no page break) | \`<h1>In the Morning</h1>\`, 2 paragraphs, \`<h1>After the Storm</h1>\`, 6 paragraphs; \`<title>In the Morning</title>\` |
| market_records.docx | $(sz $good/market_records.docx) | \`pandoc -t docx\` | Heading 1 "Market Report", then one paragraph per non-blank line of the .txt (no page breaks): 20 paragraphs in all (heading = 1): "The access code of cobalt heron is 66120." is paragraph 7, "The lucky number of jade tiger is 90455." 13, "The secret code of crimson owl is 27093." 18, "Order 116: Lisa bought 3 maps for 21 coins." 19, "Item 60: 14 bottles, fragile, stored in the kitchen." 20 (last) |
| the_diary_of_greta.epub | $(sz $good/the_diary_of_greta.epub) | \`pandoc -t epub3 --epub-chapter-level=1 -M title=Greta\` | dc:title "Greta" (a word of the sample), spine: \`text/title_page.xhtml\` ("Greta"), then 5 chapters \`text/ch001.xhtml\`..\`ch005.xhtml\`, each starting with its day as \`<h1>\`; \`nav.xhtml\` (not in the spine) also holds pandoc's landmark "Title Page". ch001 "Monday": "The pass key is 90417. Remember it."; ch002 "Tuesday": "The value of x is 52981."; ch003 "Wednesday": "The value of y is the value of x."; ch004 "Thursday": 2 letters about the observatory; ch005 "Friday": "Greta found 9 keys …", "The secret code of violet lynx is 11863." |

### Other formats

| file | bytes | producer | what to expect |
|------|------:|----------|----------------|
| notebook.ipynb | $(sz $good/notebook.ipynb) | Python json | nbformat 4.5: markdown cell "# Analysis"; code cell \`print(sum([1, 2, 3]))\` (execution_count 1) with one stream output (stdout) "6\\n"; markdown cell "The total is six."; kernelspec python3 |
| letter.eml | $(sz $good/letter.eml) | Python email (policy SMTP: CRLF) | From "Alice Example <alice@example.org>", To "Bob Example <bob@example.org>", Subject "Budget meeting", Date "Tue, 14 Jan 2025 09:30:00 +0000". multipart/mixed → [multipart/alternative → [text/plain "The budget meeting moves to Thursday.", text/html same sentence with \`<b>Thursday</b>\`], application/pdf attachment "budget.pdf" (base64; a one-page LibreOffice PDF reading "Budget for the next quarter: 8100 coins.")] |
| inbox.mbox | $(sz $good/inbox.mbox) | Python mailbox (mboxo) | 2 messages, each after a "From alice@example.org Mon Jan 13 …" line. 1: Subject "First note", body "The first note is short."; 2: Subject "Second note", body "The second note follows the first." and a line stored as \`>From the desk of Alice, with thanks.\` (the mboxo "From " escape) |
| table.csv | $(sz $good/table.csv) | Python csv (CRLF) | 4 rows × 3 columns, header \`City,Population,Note\`; rows Oslo/709000/"Capital, largest city" (quoted: has a comma), Bergen/286000/Rainy, Tromso/77000/Arctic |
| table.tsv | $(sz $good/table.tsv) | Python csv, tab, LF | same 4 rows × 3 columns, no quoting |
| data.json | $(sz $good/data.json) | Python json | \`library\` → {name "Harbor Library", address {street, city "Bergen"}, shelves [ {id 1, topic "maps", books 42}, {id 2, topic "ships", books 17} ], open true} |
| latin1.txt | $(sz $good/latin1.txt) | Python, cp1252 | 3 lines: "Café crème brûlée — naïve façade" (em dash is byte 0x97: Windows-1252, not ISO 8859-1), "The menu changes every week.", "Ask the waiter for today's dishes." |
| utf16le-bom.txt | $(sz $good/utf16le-bom.txt) | Python, UTF-16LE | BOM FF FE; 3 lines: "The harbor opens at six.", "The ferry to the café leaves at seven." (é is the only non-ASCII), "Tickets are sold on board." |
| utf16be-bom.txt | $(sz $good/utf16be-bom.txt) | Python, UTF-16BE | BOM FE FF; same 3 lines |
| scanned.pdf | $(sz $good/scanned.pdf) | \`pdftoppm -r 150 -gray -png -f 1 -l 1 report.pdf\` → \`img2pdf --pagesize Letter\` | 1 page, one 1275×1650 image (150 dpi) of report.pdf's page 1 ("Quarterly Report", "Summary" + paragraph), **no text layer**: \`pdftotext\` prints nothing (only a form feed) |

## bad/

| file | bytes | what is wrong |
|------|------:|---------------|
| encrypted.pdf | $(sz $bad/encrypted.pdf) | \`qpdf --encrypt user owner 256 -- report.pdf\`: AES-256 (R6), user password "user", owner password "owner"; nothing readable without the password (\`pdftotext -upw user\` reads it) |
| truncated.pdf | $(sz $bad/truncated.pdf) | first 40% of report.pdf's bytes ($(sz $good/report.pdf) × 0.4): no xref, trailer or %%EOF; later objects missing |
| broken-xref.pdf | $(sz $bad/broken-xref.pdf) | report.pdf, same length: ${xref_note#broken-xref.pdf: } (every byte of the 20-byte entries except line ends is now "?"; "xref", the subsection line and the trailer are intact). A strict parser fails; $xref_rebuild |
| bomb.docx | $(sz $bad/bomb.docx) | zip with [Content_Types].xml, _rels/.rels, word/document.xml; ${bomb_note#bomb.docx: } (1 GiB of "A" inside one \`<w:t>\`, deflate level 9, ratio ≈ 1000:1) |
| missing-spine.epub | $(sz $bad/missing-spine.epub) | report.epub without \`EPUB/text/ch002.xhtml\` ("Regional Figures"); content.opf still lists it in manifest and spine (so do nav.xhtml and toc.ncx) |
| entities.xml | $(sz $bad/entities.xml) | "billion laughs": entities lol1..lol9, each 10 references to the previous; \`&lol9;\` expands to 10^9 "lol" (3 GB) |
| binary.txt | $(sz $bad/binary.txt) | ${bin_note#binary.txt: } (Python \`random.Random(20250101).randbytes(4096)\`, then byte 0 of every 256 set to NUL) |
| invalid-utf8.txt | $(sz $bad/invalid-utf8.txt) | ${utf8_note#invalid-utf8.txt: }; 3 invalid bytes = 3 maximal invalid subsequences (the "(" after 0xC3 is valid ASCII and is kept); the rest is valid UTF-8 (incl. "é" in "Renée") |
| utf16le-nobom.txt | $(sz $bad/utf16le-nobom.txt) | UTF-16LE with no BOM: "The ferry leaves the harbor at seven.\\nTickets are sold on board.\\n" (every other byte NUL) |
| empty.txt | $(sz $bad/empty.txt) | zero bytes |

<details>
<summary>What qpdf --check says about broken-xref.pdf and truncated.pdf</summary>

broken-xref.pdf:

$xref_qpdf

truncated.pdf:

$trunc_qpdf

</details>

## pdftotext -layout of the PDFs (reading-order reference)

<details>
<summary>report.pdf</summary>
$(layout "$good/report.pdf")

</details>

<details>
<summary>field_notes.pdf</summary>
$(layout "$good/field_notes.pdf")

</details>
EOF

printf '* -text\n' >"$root/.gitattributes" # keep CRLF, UTF-16 and binary bytes as they are
files=("$good"/* "$bad"/*)
echo "corpus: $total bytes in ${#files[@]} files"
ls -l "$good" "$bad"
