//! HTML and EPUB: the page's main text, parsed as a browser would (html5ever, through
//! `scraper`), walked without recursion (a 100 000-deep nesting cannot overflow the stack).
//!
//! Main text: `<main>` when the page has one, else its only `<article>`, else `<body>`.
//! Dropped: scripts, styles, templates, navigation (`<nav>`, `role="navigation"`), asides,
//! footers, buttons and hidden elements (a form's text is kept: whole pages live in one). Links keep their text and, when it is not the address
//! itself, the address in parentheses. An EPUB is its spine's chapters in order, each a part
//! named by its first heading (or the table of contents' title, or its file name).

use std::collections::HashMap;

use ego_tree::iter::Edge;
use quick_xml::events::Event;
use scraper::{Html, Node};

use crate::limits::{Budget, LimitHit};
use crate::out::{collapse, Out};
use crate::plain::{attr, walk_xml, Decoded};
use crate::zipped::Container;
use crate::{Extracted, Format, Refusal};

/// Bytes of HTML parsed between two checks of the clock.
const PARSE_PIECE_BYTES: usize = 16 << 10;

/// Elements whose content is never the page's text.
const DROPPED: [&str; 13] = [
    "script", "style", "noscript", "template", "nav", "aside", "footer", "button", "select", "iframe", "svg", "canvas",
    "head",
];
/// Elements that start a new block of text.
const BLOCKS: [&str; 18] = [
    "p",
    "div",
    "section",
    "article",
    "main",
    "header",
    "blockquote",
    "figure",
    "figcaption",
    "dl",
    "dt",
    "dd",
    "address",
    "details",
    "summary",
    "hr",
    "center",
    "body",
];

pub(crate) fn html(decoded: &Decoded, budget: &Budget) -> Result<Extracted, Refusal> {
    let mut out = Out::new(budget);
    page_into(&mut out, &decoded.text, budget)?;
    for w in &decoded.warnings {
        out.warn(w.clone());
    }
    Ok(out.finish())
}

/// A list being read: ordered ones count their items.
struct List {
    ordered: bool,
    next: usize,
}

/// The text of one HTML page, appended to `out`.
fn page_into(out: &mut Out, source: &str, budget: &Budget) -> Result<(), LimitHit> {
    let page = parse(source, budget)?;
    let root = page.tree.root();
    let element = |name: &'static str| {
        root.descendants().filter(move |n| n.value().as_element().is_some_and(|e| e.name() == name))
    };
    let articles: Vec<_> = element("article").take(2).collect();
    let start = element("main")
        .next()
        .or(if articles.len() == 1 { articles.first().copied() } else { None })
        .or_else(|| element("body").next())
        .unwrap_or(root);
    let mut walk = Walk::default();
    let mut skip: Option<ego_tree::NodeId> = None;
    let mut depth = 0usize;
    for edge in start.traverse() {
        match edge {
            Edge::Open(node) => {
                depth += 1;
                budget.depth(depth)?;
                if skip.is_some() {
                    continue;
                }
                match node.value() {
                    Node::Text(t) => walk.text(t),
                    Node::Element(e) if is_dropped(e) => skip = Some(node.id()),
                    Node::Element(e) => walk.open(out, e)?,
                    _ => {}
                }
            }
            Edge::Close(node) => {
                depth -= 1;
                if skip == Some(node.id()) {
                    skip = None;
                } else if let (None, Node::Element(e)) = (skip, node.value()) {
                    walk.close(out, e.name())?;
                }
            }
        }
    }
    flush(out, &mut walk.para, false)
}

/// An element whose content is not the page's text: scripts, navigation, hidden parts.
fn is_dropped(e: &scraper::node::Element) -> bool {
    DROPPED.contains(&e.name())
        || e.attr("hidden").is_some()
        || e.attr("aria-hidden") == Some("true")
        || e.attr("role") == Some("navigation")
}

/// Where a walk through a page stands: the paragraph being gathered, the heading, lists,
/// list item, table row and cell, `<pre>` depth and open links it is inside.
#[derive(Default)]
struct Walk {
    para: String,
    heading: Option<usize>,
    lists: Vec<List>,
    item: Option<String>,
    row: Vec<String>,
    cell: Option<String>,
    pre: usize,
    links: Vec<(usize, String)>,
}

impl Walk {
    fn text(&mut self, t: &str) {
        let target = self.cell.as_mut().unwrap_or(&mut self.para);
        if self.pre > 0 {
            target.push_str(t);
        } else {
            target.push_str(&t.replace('\n', " "));
        }
    }

    fn open(&mut self, out: &mut Out, e: &scraper::node::Element) -> Result<(), LimitHit> {
        let name = e.name();
        match name {
            "h1" | "h2" | "h3" | "h4" | "h5" | "h6" => {
                flush(out, &mut self.para, self.item.is_some())?;
                self.heading = Some(usize::from(name.as_bytes()[1] - b'0'));
            }
            "ul" | "ol" => {
                // An item's own text before its nested list is written as the item.
                match self.item.take() {
                    Some(marker) => {
                        let depth = self.lists.len().saturating_sub(1);
                        out.item(depth, &marker, &lines(&std::mem::take(&mut self.para)))?;
                    }
                    None => flush(out, &mut self.para, false)?,
                }
                self.lists.push(List { ordered: name == "ol", next: 1 });
            }
            "li" => {
                flush(out, &mut self.para, false)?;
                self.item = Some(match self.lists.last_mut() {
                    Some(List { ordered: true, next }) => {
                        *next += 1;
                        format!("{}.", *next - 1)
                    }
                    _ => "-".to_owned(),
                });
            }
            "table" => {
                flush(out, &mut self.para, false)?;
                out.end_block()?;
            }
            "tr" => self.row.clear(),
            "td" | "th" => self.cell = Some(String::new()),
            "pre" => {
                flush(out, &mut self.para, false)?;
                self.pre += 1;
            }
            "br" => self.cell.as_mut().unwrap_or(&mut self.para).push('\n'),
            "a" => self.links.push((self.para.len(), e.attr("href").unwrap_or("").to_owned())),
            "img" => {
                if let Some(alt) = e.attr("alt").filter(|a| !a.trim().is_empty()) {
                    self.para.push_str(&format!(" [image: {}] ", alt.trim()));
                }
            }
            n if BLOCKS.contains(&n) => flush(out, &mut self.para, self.item.is_some())?,
            _ => {}
        }
        Ok(())
    }

    fn close(&mut self, out: &mut Out, name: &str) -> Result<(), LimitHit> {
        match name {
            "h1" | "h2" | "h3" | "h4" | "h5" | "h6" => {
                if let Some(level) = self.heading.take() {
                    out.heading(level, &std::mem::take(&mut self.para))?;
                }
            }
            "li" => {
                let depth = self.lists.len().saturating_sub(1);
                if let Some(marker) = self.item.take() {
                    out.item(depth, &marker, &lines(&std::mem::take(&mut self.para)))?;
                }
            }
            "ul" | "ol" => {
                flush(out, &mut self.para, false)?;
                self.lists.pop();
                if self.lists.is_empty() {
                    out.end_block()?;
                }
            }
            "td" | "th" => self.row.extend(self.cell.take()),
            "tr" => out.row(&std::mem::take(&mut self.row))?,
            "table" => out.end_block()?,
            "pre" => {
                self.pre = self.pre.saturating_sub(1);
                if self.pre == 0 {
                    out.verbatim(&std::mem::take(&mut self.para))?;
                }
            }
            "a" => {
                if let Some((at, href)) = self.links.pop() {
                    let text = self.para.get(at..).unwrap_or("").trim().to_owned();
                    let absolute = href.starts_with("http://") || href.starts_with("https://");
                    if absolute && !text.is_empty() && text != href {
                        self.para.push_str(&format!(" ({href})"));
                    }
                }
            }
            n if BLOCKS.contains(&n) => flush(out, &mut self.para, self.item.is_some())?,
            _ => {}
        }
        Ok(())
    }
}

/// `source` parsed a piece at a time with the clock checked between pieces: html5ever's
/// tree building is quadratic on pathological nesting (every start tag scans the stack of
/// open elements), and a page must stop at the time limit, not run on.
fn parse(source: &str, budget: &Budget) -> Result<Html, LimitHit> {
    use html5ever::tendril::TendrilSink;
    let mut parser =
        html5ever::driver::parse_document(scraper::HtmlTreeSink::new(Html::new_document()), Default::default());
    let mut rest = source;
    while !rest.is_empty() {
        budget.tick()?;
        let mut cut = rest.len().min(PARSE_PIECE_BYTES);
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        parser.process(rest[..cut].into());
        rest = &rest[cut..];
    }
    Ok(parser.finish())
}

/// Ends the paragraph being read (unless it is a list item's text, which its `</li>` ends).
fn flush(out: &mut Out, para: &mut String, in_item: bool) -> Result<(), LimitHit> {
    if in_item {
        return Ok(());
    }
    out.paragraph(&lines(&std::mem::take(para)))
}

/// Inline text with its `<br>` line breaks kept and other whitespace collapsed.
fn lines(text: &str) -> String {
    text.split('\n').map(collapse).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("\n")
}

/// An EPUB: its spine's documents in order, each a part.
pub(crate) fn epub(bytes: &[u8], budget: &Budget) -> Result<Extracted, Refusal> {
    let mut zip = Container::open(bytes, Format::Epub, budget)?;
    if let Some(encryption) = zip.text("META-INF/encryption.xml")? {
        // Font obfuscation also lists entries here; encrypted chapters mean DRM.
        if [".xhtml", ".html", ".htm"].iter().any(|ext| encryption.contains(&format!("{ext}\""))) {
            return Err(Refusal::Encrypted);
        }
    }
    let container = zip.required("META-INF/container.xml")?;
    let opf_path = first_attr(&container, "rootfile", "full-path", budget)?
        .ok_or_else(|| Refusal::damaged(Format::Epub, "META-INF/container.xml names no package (rootfile)"))?;
    let opf = zip.required(&opf_path)?;
    let package = Package::read(&opf, budget)?;
    let base = opf_path.rsplit_once('/').map_or(String::new(), |(dir, _)| format!("{dir}/"));
    let titles = match package.nav.as_ref().map(|href| resolve(&base, href)) {
        Some(nav) => zip.text(&nav)?.map(|t| toc_titles(&t, &nav, budget)).transpose()?.unwrap_or_default(),
        None => HashMap::new(),
    };
    let mut out = Out::new(budget);
    if package.spine.is_empty() {
        return Err(Refusal::damaged(Format::Epub, "its spine lists no chapters"));
    }
    for idref in &package.spine {
        let Some(href) = package.items.get(idref) else {
            return Err(Refusal::damaged(
                Format::Epub,
                format!("its spine lists \"{idref}\", which its manifest does not"),
            ));
        };
        let path = resolve(&base, href);
        let Some(chapter) = zip.text(&path)? else {
            return Err(Refusal::damaged(Format::Epub, format!("its spine lists {path}, which is not in the EPUB")));
        };
        let fallback = path.rsplit('/').next().unwrap_or(&path).to_owned();
        out.part(titles.get(&path).cloned().unwrap_or(fallback));
        page_into(&mut out, &chapter, budget)?;
    }
    Ok(out.finish())
}

/// What an OPF package says: manifest ids to paths, the spine's order, the navigation document.
struct Package {
    items: HashMap<String, String>,
    spine: Vec<String>,
    nav: Option<String>,
}

impl Package {
    fn read(opf: &str, budget: &Budget) -> Result<Self, Refusal> {
        let mut package = Package { items: HashMap::new(), spine: Vec::new(), nav: None };
        walk_xml(opf, Format::Epub, budget, |event, _| {
            let (Event::Start(e) | Event::Empty(e)) = event else { return Ok(()) };
            let get = |name: &str| attr(&e, name);
            match e.local_name().as_ref() {
                "item" => {
                    if let (Some(id), Some(href)) = (get("id"), get("href")) {
                        if get("properties").is_some_and(|p| p.split_whitespace().any(|p| p == "nav")) {
                            package.nav = Some(href.clone());
                        }
                        package.items.insert(id, href);
                    }
                }
                "itemref" if get("linear").as_deref() != Some("no") => package.spine.extend(get("idref")),
                _ => {}
            }
            Ok(())
        })?;
        Ok(package)
    }
}

/// The first value of attribute `attr` on an element named `element`.
fn first_attr(xml: &str, element: &str, name: &str, budget: &Budget) -> Result<Option<String>, Refusal> {
    let mut found = None;
    walk_xml(xml, Format::Epub, budget, |event, _| {
        if let (Event::Start(e) | Event::Empty(e), None) = (event, &found) {
            if e.local_name().as_ref() == element {
                found = Some(attr(&e, name));
            }
        }
        Ok(())
    })?;
    Ok(found.flatten())
}

/// Chapter titles from an EPUB 3 navigation document: each linked file's first entry.
fn toc_titles(nav: &str, nav_path: &str, budget: &Budget) -> Result<HashMap<String, String>, LimitHit> {
    let base = nav_path.rsplit_once('/').map_or(String::new(), |(dir, _)| format!("{dir}/"));
    let page = parse(nav, budget)?;
    let mut titles = HashMap::new();
    let links = page.tree.root().descendants().filter_map(|n| {
        let e = n.value().as_element()?;
        (e.name() == "a").then(|| (e.attr("href").unwrap_or("").to_owned(), n))
    });
    for (href, node) in links {
        let file = href.split('#').next().unwrap_or("");
        let text: String = node.descendants().filter_map(|d| d.value().as_text().map(|t| t.to_string())).collect();
        let text = collapse(&text);
        if !file.is_empty() && !text.is_empty() {
            titles.entry(resolve(&base, file)).or_insert(text);
        }
    }
    Ok(titles)
}

/// `href` (percent-encoded, relative to `base`, maybe with `..`) as a path in the ZIP.
fn resolve(base: &str, href: &str) -> String {
    let href = percent_decode(href.split('#').next().unwrap_or(""));
    let mut parts: Vec<&str> = if href.starts_with('/') { Vec::new() } else { base.split('/').collect() };
    parts.retain(|p| !p.is_empty());
    for piece in href.split('/') {
        match piece {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Limits;

    fn read(source: &str) -> Extracted {
        let limits = Limits::default();
        let budget = Budget::start(&limits);
        html(&Decoded { text: source.into(), warnings: Vec::new() }, &budget).unwrap()
    }

    #[test]
    fn main_text_keeps_structure_and_drops_chrome() {
        let got = read(
            "<html><head><title>t</title><style>p{}</style></head><body><nav>Home About</nav>\
             <h1>Report</h1><p>First  <b>bold</b>\n line.<br>Second line.</p>\
             <ul><li>one</li><li>two <a href=\"https://x.org/a\">link</a></li></ul>\
             <ol><li>first</li><li>second</li></ol>\
             <table><tr><th>A</th><th>B</th></tr><tr><td>1</td><td>2</td></tr></table>\
             <h2>Next</h2><pre>  code\n    indented</pre><script>var x = 1;</script><footer>© me</footer></body></html>",
        );
        assert_eq!(
            got.text,
            "# Report\n\nFirst bold line.\nSecond line.\n\n- one\n- two link (https://x.org/a)\n\n1. first\n2. second\n\n\
             | A | B |\n| 1 | 2 |\n\n## Next\n\n  code\n    indented\n"
        );
        let labels: Vec<&str> = got.parts.iter().map(|p| p.label.as_str()).collect();
        assert_eq!(labels, ["Report", "Next"]);
    }

    #[test]
    fn nested_lists_keep_the_outer_item() {
        let got = read(
            "<body><ul><li>outer<ul><li>inner</li></ul></li><li>next</li></ul><form><p>In a form.</p></form></body>",
        );
        assert_eq!(got.text, "- outer\n  - inner\n- next\n\nIn a form.\n");
    }

    /// Deep nesting meets the depth limit in our walk (no recursion to overflow), and nesting
    /// that makes html5ever's tree building quadratic meets the time limit as it parses.
    #[test]
    fn deep_nesting_hits_the_depth_or_time_limit() {
        let limits = Limits::default();
        let budget = Budget::start(&limits);
        let deep = format!("<html><body>{}x</body></html>", "<div>".repeat(5_000));
        let e = html(&Decoded { text: deep, warnings: Vec::new() }, &budget).unwrap_err();
        assert_eq!(e.to_string(), "nested deeper than 512 levels (nesting depth limit)");

        let limits = Limits { time: std::time::Duration::from_millis(500), ..Limits::default() };
        let budget = Budget::start(&limits);
        let deeper = format!("<html><body>{}x</body></html>", "<div>".repeat(400_000));
        let started = std::time::Instant::now();
        let e = html(&Decoded { text: deeper, warnings: Vec::new() }, &budget).unwrap_err();
        assert!(e.to_string().ends_with("(time limit per document)"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(10), "stopped after {:?}", started.elapsed());
    }

    #[test]
    fn epub_paths_resolve_relative_to_the_package() {
        assert_eq!(resolve("OEBPS/", "text/ch%201.xhtml#x"), "OEBPS/text/ch 1.xhtml");
        assert_eq!(resolve("OEBPS/text/", "../ch2.xhtml"), "OEBPS/ch2.xhtml");
        assert_eq!(resolve("", "ch3.xhtml"), "ch3.xhtml");
    }
}
