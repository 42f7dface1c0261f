// @vitest-environment jsdom
import { describe, expect, it } from 'vitest';
import { renderMarkdown } from './markdown';

describe('renderMarkdown', () => {
  it('renders Markdown: emphasis, lists, code blocks, tables', () => {
    const html = renderMarkdown('**bold** and `code`\n\n- one\n- two\n\n```rust\nfn main() {}\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |');
    expect(html).toContain('<strong>bold</strong>');
    expect(html).toContain('<code>code</code>');
    expect(html).toMatch(/<li>one<\/li>/);
    expect(html).toMatch(/<pre><code>fn main\(\) \{\}/);
    expect(html).toContain('<td>2</td>');
  });

  it('removes what could run or load: scripts, handlers, javascript: links, images, iframes', () => {
    const html = renderMarkdown(
      'hi <script>alert(1)</script> <img src=x onerror="alert(2)"> <iframe src="https://example.com"></iframe> ' +
        '<a href="javascript:alert(3)">x</a> <b onclick="alert(4)">b</b> <style>body{display:none}</style> [y](javascript:alert(5))',
    );
    for (const bad of ['<script', 'onerror', '<img', '<iframe', 'javascript:', 'onclick', '<style', 'alert(']) {
      expect(html).not.toContain(bad);
    }
    expect(html).toContain('<b>b</b>');
  });

  it("keeps an answer from borrowing the app's classes and ids", () => {
    const html = renderMarkdown('<div class="drop-overlay" id="composer-input">x</div>');
    expect(html).not.toContain('drop-overlay');
    expect(html).not.toContain('composer-input');
  });

  it('keeps a link text and its address as a tooltip, without navigation', () => {
    const html = renderMarkdown('see [the docs](https://example.com/a)');
    expect(html).toContain('the docs');
    expect(html).toContain('title="https://example.com/a"');
    expect(html).not.toContain('href=');
  });
});
