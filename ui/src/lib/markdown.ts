// Answers rendered as Markdown, made safe to insert. marked (GFM) renders; DOMPurify then
// removes anything that could run or reach out: scripts, event handlers, javascript: and
// other non-http links, iframes, forms, styles and images (an answer may quote a document
// that holds any of them). Links keep their text and show their address as a tooltip, but do
// not navigate: a click would replace the app's page in the webview.

import DOMPurify from 'dompurify';
import { marked } from 'marked';

/** Tags an answer never needs: remote loads, styling of the app, inputs. */
const FORBIDDEN_TAGS = ['img', 'picture', 'video', 'audio', 'source', 'style', 'form', 'input', 'button', 'textarea', 'select', 'iframe', 'object', 'embed', 'svg', 'math'];

let hooked = false;

function hookLinks(purify: typeof DOMPurify) {
  if (hooked) return;
  hooked = true;
  purify.addHook('afterSanitizeAttributes', (node) => {
    if (node.tagName === 'A') {
      const href = node.getAttribute('href');
      node.removeAttribute('href');
      if (href && /^https?:\/\//i.test(href)) node.setAttribute('title', href);
      node.setAttribute('class', 'link'); // set after the attributes were sanitised
    }
  });
}

/** `text` (Markdown) as HTML safe to insert with `{@html}`. */
export function renderMarkdown(text: string): string {
  hookLinks(DOMPurify);
  const html = marked.parse(text, { async: false, gfm: true, breaks: true });
  // class and id too: an answer must not borrow the app's own styles (an overlay, a notice).
  return DOMPurify.sanitize(html, { FORBID_TAGS: FORBIDDEN_TAGS, FORBID_ATTR: ['style', 'class', 'id'] });
}
