// A small, safe markdown renderer for model replies: the text is HTML-escaped *first*, so nothing a model
// writes can become markup; only the constructs below are then turned into tags. Links keep http(s)/mailto
// targets only. Handles fenced code blocks (also while still open, as a reply streams), inline code,
// headings, bold, italic, bullet and numbered lists, links and paragraphs.
"use strict";
(function () {
  function escapeHtml(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  function inline(escaped) {
    // Code spans first, parked behind placeholders so the emphasis rules never reach inside them.
    const spans = [];
    let s = escaped.replace(/`([^`\n]+)`/g, (_, code) => { spans.push(code); return "\u0000" + (spans.length - 1) + "\u0000"; });
    s = s.replace(/\[([^\]\n]+)\]\(((?:https?:\/\/|mailto:)[^)\s]+)\)/g,
      (_, label, url) => '<a href="' + url + '" target="_blank" rel="noopener noreferrer">' + label + "</a>");
    s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_\n]+)__/g, "<strong>$1</strong>");
    s = s.replace(/(^|[^*\w])\*([^*\n]+)\*(?!\*)/g, "$1<em>$2</em>").replace(/(^|[^_\w])_([^_\n]+)_(?!\w)/g, "$1<em>$2</em>");
    return s.replace(/\u0000(\d+)\u0000/g, (_, i) => "<code>" + spans[Number(i)] + "</code>");
  }

  function blocks(text) {
    const out = [];
    let para = [], list = null;
    const flushPara = () => { if (para.length) { out.push("<p>" + para.map(inline).join("<br>") + "</p>"); para = []; } };
    const flushList = () => { if (list) { out.push("<" + list.tag + ">" + list.items.map((i) => "<li>" + inline(i) + "</li>").join("") + "</" + list.tag + ">"); list = null; } };
    for (const line of text.split("\n")) {
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
      const numbered = /^\s*\d+[.)]\s+(.*)$/.exec(line);
      if (heading) {
        flushPara(); flushList();
        const level = Math.min(heading[1].length + 2, 6);  // h3..h6: a reply's headings sit inside the page
        out.push("<h" + level + ">" + inline(heading[2]) + "</h" + level + ">");
      } else if (bullet || numbered) {
        flushPara();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tag !== tag) { flushList(); list = { tag: tag, items: [] }; }
        list.items.push((bullet || numbered)[1]);
      } else if (!line.trim()) {
        flushPara(); flushList();
      } else {
        flushList(); para.push(line);
      }
    }
    flushPara(); flushList();
    return out.join("");
  }

  function render(markdown) {
    const parts = markdown.split(/^```/m);  // even: prose, odd: a code block (its first line the language)
    let html = "";
    parts.forEach((part, i) => {
      if (i % 2 === 0) { html += blocks(escapeHtml(part)); return; }
      const nl = part.indexOf("\n");
      const lang = nl < 0 ? part.trim() : part.slice(0, nl).trim();
      const code = nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "");
      const cls = /^[\w+#-]+$/.test(lang) ? ' class="language-' + lang + '"' : "";
      html += "<pre><code" + cls + ">" + escapeHtml(code) + "</code></pre>";
    });
    return html;
  }

  window.PagedMarkdown = { render: render, escapeHtml: escapeHtml };
})();
