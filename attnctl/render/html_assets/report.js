/* attnctl run --html: draws the run's JSON document (the script block "attnctl-data").
   Plain JavaScript, no library, nothing fetched; every user string goes in as textContent. */
(function () {
  "use strict";

  /* the SVG namespace, read from the page's own <svg> (the HTML parser gives it): no URL here */
  var SVG = document.getElementById("svg-namespace").namespaceURI;
  var ROW = 24; /* px between tokens in the head view */
  var ALL_KEYS_LIMIT = 128; /* more keys than this: the head view draws each row's top-k */
  var KEY_COLUMN_LIMIT = 160; /* more keys than this in the top-k union: one row at a time */
  var MATRIX_WIDTH = 520; /* px of cells in a head's matrix at most */
  var CELL_MAX = 22;
  var THUMB = 76; /* px of a model-view cell */
  var MAX_TEXT = 200; /* characters of a text in the header */
  var FOCUS_ROWS = 24; /* weights listed beside the head view at most */
  var MASKED_FILL = "#dfe2e8"; /* a matrix cell whose weight is exactly 0: a masked key */

  var doc = JSON.parse(document.getElementById("attnctl-data").textContent);
  var root = document.getElementById("report");

  /* ------------------------------------------------------------ helpers */

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function svgEl(tag, attrs, text) {
    var node = document.createElementNS(SVG, tag);
    setAttrs(node, attrs);
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function setAttrs(node, attrs) {
    if (!attrs) return;
    Object.keys(attrs).forEach(function (name) {
      var value = attrs[name];
      if (value === undefined || value === null || value === false) return;
      if (name === "class") node.setAttribute("class", value);
      else node.setAttribute(name, String(value));
    });
  }
  function range(n) {
    var out = [];
    for (var i = 0; i < n; i++) out.push(i);
    return out;
  }
  function isList(value) {
    return Array.isArray(value);
  }

  /* user text made visible: control and format characters as escapes (as the terminal) */
  function printable(text) {
    return String(text).replace(/[\u0000-\u001f\u007f-\u009f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb]/g, function (c) {
      var named = { "\n": "\\n", "\t": "\\t", "\r": "\\r" }[c];
      if (named) return named;
      var code = c.charCodeAt(0);
      return code < 256 ? "\\x" + code.toString(16).padStart(2, "0") : "\\u" + code.toString(16).padStart(4, "0");
    });
  }
  /* a token's label: its text span, spaces shown as ␣, an empty span as ∅, shortened */
  function tokenLabel(token, width) {
    var label = printable(token && token.text !== undefined && token.text !== null ? token.text : "");
    if (label.trim() === "") label = label.replace(/ /g, "\u2423") || "\u2205";
    var chars = Array.from(label);
    if (width && chars.length > width) label = chars.slice(0, width - 1).join("") + "\u2026";
    return label;
  }
  /* a long text shortened for the header, as the terminal does */
  function shownText(text, quoted) {
    var chars = Array.from(printable(text));
    var open = quoted ? "\u201c" : "", close = quoted ? "\u201d" : "";
    if (chars.length <= MAX_TEXT) return open + chars.join("") + close;
    return open + chars.slice(0, MAX_TEXT).join("") + "\u2026" + close + " (" + Array.from(text).length.toLocaleString("en-US") + " characters in all)";
  }
  function formatBytes(bytes) {
    if (typeof bytes !== "number") return "\u2014";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var value = bytes, unit = 0;
    while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit++; }
    return unit === 0 ? bytes + " B" : value.toFixed(2) + " " + units[unit];
  }
  /* a weight as read out: 3 significant digits, scientific below 0.01; exactly 0 is a masked
     key (causal, window or padding: the encoding keeps any weight above 0 above 0) */
  function weightText(value) {
    if (typeof value !== "number" || !isFinite(value)) return "\u2014";
    if (value === 0) return "\u2014";
    return value >= 0.01 ? value.toPrecision(3) : value.toExponential(2);
  }
  function fixed(value, digits) {
    return typeof value === "number" ? value.toFixed(digits) : "\u2014";
  }
  /* head colours: evenly spaced hues, the same for the same head everywhere */
  function headColour(position, count) {
    var hue = Math.round((position * 360) / Math.max(count, 1) + 215) % 360;
    return "hsl(" + hue + ", 68%, 46%)";
  }

  /* ------------------------------------------------------------ the data */

  function base64Bytes(text) {
    var binary = atob(text);
    var bytes = new Uint8Array(binary.length);
    for (var i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }
  /* an attention array as attnctl/render/html.py encoded it: per row its largest weight
     (float32) and each weight as a fraction of it (8 or 16 bits) */
  function decodeAttention(encoded) {
    if (!encoded || encoded.encoding !== "rowmax-uint") return null;
    var shape = encoded.shape;
    var maxima = new Float32Array(base64Bytes(encoded.row_max).buffer);
    var raw = base64Bytes(encoded.data);
    var levels = encoded.bits === 16 ? new Uint16Array(raw.buffer) : raw;
    var top = Math.pow(2, encoded.bits) - 1;
    var B = shape[0], H = shape[1], R = shape[2], K = shape[3];
    return {
      B: B, H: H, R: R, K: K,
      rowMax: function (b, h, r) { return maxima[(b * H + h) * R + r]; },
      row: function (b, h, r) {
        var index = (b * H + h) * R + r;
        var scale = maxima[index] / top;
        var out = new Float32Array(K);
        var start = index * K;
        for (var k = 0; k < K; k++) out[k] = levels[start + k] * scale;
        return out;
      }
    };
  }

  function tokensOf(list, b) {
    return isList(list) && isList(list[b]) ? list[b] : [];
  }

  /* the attentions the document holds, each with its blocks: one for a run, three for an
     encoder–decoder (encoder self, decoder self, cross) */
  function attentionSources() {
    var found = [];
    var layers = doc.layers;
    function blocksOf(kind, single, singleLayer, stats) {
      /* --layer all: the blocks are listed (by kind for an encoder–decoder) */
      var listed = kind === null ? (isList(layers) ? layers : null) : (layers && !isList(layers) ? layers[kind] : null);
      if (isList(listed) && listed.length) {
        return listed.map(function (block) {
          return { layer: block.layer, attention: decodeAttention(block.attention), stats: block.head_stats || null };
        }).filter(function (block) { return block.attention; });
      }
      var attention = decodeAttention(single);
      return attention ? [{ layer: singleLayer, attention: attention, stats: stats || null }] : [];
    }
    if (isList(doc.source_tokens) && isList(doc.target_tokens)) {
      var sourceRows = isList(doc.attention_rows) ? doc.attention_rows : null;
      found.push({ id: "encoder", name: "encoder self-attention", queries: doc.source_tokens, keys: doc.source_tokens,
        rows: sourceRows, querySide: "source", keySide: "source",
        blocks: blocksOf("encoder", doc.encoder_attention, doc.encoder_layer, doc.encoder_head_stats) });
      found.push({ id: "decoder", name: "decoder self-attention", queries: doc.target_tokens, keys: doc.target_tokens,
        rows: null, querySide: "target", keySide: "target",
        blocks: blocksOf("decoder", doc.decoder_attention, doc.decoder_layer, doc.decoder_head_stats) });
      found.push({ id: "cross", name: "cross-attention (target \u2192 source)", queries: doc.target_tokens, keys: doc.source_tokens,
        rows: null, querySide: "target", keySide: "source",
        blocks: blocksOf("cross", doc.cross_attention, doc.decoder_layer, doc.cross_head_stats) });
    } else {
      var context = isList(doc.context_tokens);
      found.push({ id: context ? "cross" : "self", name: context ? "cross-attention (text \u2192 context)" : "self-attention",
        queries: doc.tokens || [], keys: context ? doc.context_tokens : (doc.tokens || []),
        rows: isList(doc.attention_rows) ? doc.attention_rows : null,
        querySide: context ? "text" : "queries", keySide: context ? "context" : "keys",
        blocks: blocksOf(null, doc.attention, doc.layer, doc.head_stats) });
    }
    return found.filter(function (source) { return source.blocks.length; }).map(function (source) {
      var R = source.blocks[0].attention.R;
      if (!source.rows || source.rows.length !== R) source.rows = range(R);
      return source;
    });
  }

  /* which tokens are generated (and not the prompt) */
  function generatedFrom(source, side, b) {
    if (isList(doc.source_tokens)) return side === "target" ? 1 : Infinity; /* after the start token */
    if (isList(doc.prompt_tokens) && side !== "context") return tokensOf(doc.prompt_tokens, b).length;
    return Infinity;
  }
  /* "piece 2/3 of one character": tokens sharing one non-empty character span */
  function pieceNotes(tokens) {
    var notes = tokens.map(function () { return ""; });
    var i = 0;
    while (i < tokens.length) {
      var j = i + 1;
      var t = tokens[i];
      while (j < tokens.length && !t.pad && t.end > t.start && tokens[j].start === t.start && tokens[j].end === t.end) j++;
      if (j - i > 1) for (var p = i; p < j; p++) notes[p] = "piece " + (p - i + 1) + "/" + (j - i) + " of one character";
      i = j;
    }
    return notes;
  }

  var sources = attentionSources();
  var heads = isList(doc.attention_heads) ? doc.attention_heads : [];
  if (sources.length && heads.length !== sources[0].blocks[0].attention.H) heads = range(sources[0].blocks[0].attention.H);
  var batchSize = sources.length ? sources[0].blocks[0].attention.B : 0;

  var state = {
    source: 0,
    block: 0,
    batch: 0,
    selected: heads.map(function () { return true; }),
    mode: "auto",
    topK: 8,
    focus: null,
    pinned: false,
    row: null
  };
  function current() {
    var source = sources[state.source];
    var block = source.blocks[Math.min(state.block, source.blocks.length - 1)];
    return { source: source, block: block, attention: block.attention };
  }
  function edgeMode() {
    var K = current().attention.K;
    if (state.mode === "auto") return K > ALL_KEYS_LIMIT ? "topk" : "all";
    if (state.mode === "all" && K > ALL_KEYS_LIMIT) return "topk";
    return state.mode;
  }

  /* ------------------------------------------------------------ the header */

  function textsOf(tokenLists) {
    return (tokenLists || []).map(function (row) {
      var spans = [];
      var last = -1;
      row.forEach(function (t) {
        if (t.pad || t.start < 0 || t.end <= t.start || t.start < last) return;
        if (last >= 0 && t.start > last) spans.push(" "); /* what lay between: not in the document */
        spans.push(t.text);
        last = t.end;
      });
      return spans.join("");
    });
  }
  function summary() {
    var header = el("header", { class: "summary" });
    var title = el("h1", null, "attnctl run");
    var kind = isList(doc.source_tokens) ? "encoder\u2013decoder" : isList(doc.prompt_tokens) ? "generation" :
      isList(doc.layers) ? "every block" : isList(doc.context_tokens) ? "cross-attention" : "one attention layer";
    title.appendChild(el("span", { class: "sub" }, kind));
    header.appendChild(title);
    var list = el("dl");
    function row(name, value) {
      if (value === undefined || value === null || value === "") return;
      list.appendChild(el("dt", null, name));
      list.appendChild(el("dd", null, value));
    }
    var model = doc.model;
    var config = doc.config || {};
    var texts = isList(doc.prompt_tokens) ? textsOf(doc.prompt_tokens) : textsOf(doc.source_tokens || doc.tokens);
    texts.forEach(function (text, b) { row(texts.length > 1 ? "text " + b : "text", shownText(text)); });
    if (isList(doc.context_tokens)) textsOf(doc.context_tokens).forEach(function (text, b) { row("context " + b, shownText(text)); });
    if (isList(doc.generated_text)) doc.generated_text.forEach(function (text, b) {
      row(doc.generated_text.length > 1 ? "generated " + b : "generated", shownText(text, true));
    });
    if (doc.stop) row("stop", doc.stop);
    if (model) {
      var layersText = model.layers !== undefined ? model.layers + " blocks" :
        model.encoder_layers + " + " + model.decoder_layers + " blocks";
      row("model", printable(model.path) + " \u00b7 " + (model.family || model.model_type || "") + " \u00b7 " + layersText +
        " \u00b7 hidden " + model.hidden + " \u00b7 heads " + model.heads + (model.kv_heads && model.kv_heads !== model.heads ? " (kv " + model.kv_heads + ")" : ""));
    }
    if (typeof doc.layer === "number") row("block", doc.layer);
    if (typeof doc.encoder_layer === "number") row("blocks", "encoder " + doc.encoder_layer + " \u00b7 decoder " + doc.decoder_layer);
    if (config.d_model) {
      /* a checkpoint: its own positions (GPT-2's are learned, added to its embeddings) and no
         seed (its weights are read, not drawn); the seeded layer: its config as given */
      var facts = ["d_model " + config.d_model, "heads " + config.heads + (config.kv_heads && config.kv_heads !== config.heads ? " (kv " + config.kv_heads + ")" : "")];
      facts.push(model ? "positions " + (model.positions || config.pos) : "pos " + config.pos);
      facts.push("mask " + config.mask, "norm " + config.norm);
      if (config.window) facts.push("window " + config.window);
      if (!model) facts.push("seed " + config.seed);
      row(model ? (isList(doc.source_tokens) ? "encoder attention" : "attention layer") : "layer", facts.join(" \u00b7 "));
    }
    row("tokenizer", doc.tokenizer ? printable(doc.tokenizer) + (doc.vocab_size ? " (vocab " + doc.vocab_size + ")" : "") : null);
    row("device", [doc.device, doc.dtype || config.dtype].filter(Boolean).join(" \u00b7 "));
    row("attention", doc.impl);
    header.appendChild(list);
    return header;
  }

  /* ------------------------------------------------------------ controls */

  var controls, headView, matrices, modelView, statsSection, tokensSection;

  function selectField(id, caption, options, value, onChange) {
    var label = el("label", { class: "field" });
    label.appendChild(document.createTextNode(caption));
    var select = el("select", { id: id });
    options.forEach(function (option, index) {
      var node = el("option", { value: index }, option);
      if (index === value) node.selected = true;
      select.appendChild(node);
    });
    select.addEventListener("change", function () { onChange(Number(select.value)); });
    label.appendChild(select);
    return label;
  }

  function buildControls() {
    controls.textContent = "";
    var now = current();
    if (sources.length > 1) {
      controls.appendChild(selectField("source-select", "attention", sources.map(function (s) { return s.name; }), state.source, function (value) {
        state.source = value; state.block = Math.min(state.block, sources[value].blocks.length - 1); state.focus = null; redraw(true);
      }));
    }
    if (now.source.blocks.length > 1) {
      controls.appendChild(selectField("layer-select", "block", now.source.blocks.map(function (block) { return "block " + block.layer; }), state.block, function (value) {
        state.block = value; state.focus = null; redraw(false);
      }));
    }
    if (batchSize > 1) {
      var texts = textsOf(isList(doc.source_tokens) ? doc.source_tokens : doc.tokens);
      controls.appendChild(selectField("batch-select", "text", range(batchSize).map(function (b) {
        return b + ": " + tokenLabel({ text: texts[b] || "" }, 28);
      }), state.batch, function (value) { state.batch = value; state.focus = null; redraw(false); }));
    }
    var modes = ["auto", "all", "topk"];
    var modeNames = ["lines: auto", "lines: every key", "lines: top-k keys"];
    controls.appendChild(selectField("edge-mode", "", modeNames, modes.indexOf(state.mode), function (value) {
      state.mode = modes[value]; drawHeadView();
    }));
    var kLabel = el("label", { class: "field" });
    kLabel.appendChild(document.createTextNode("k"));
    var kInput = el("input", { id: "top-k", type: "number", min: 1, max: 64, value: state.topK });
    kInput.addEventListener("change", function () {
      var value = Math.max(1, Math.min(64, Math.round(Number(kInput.value) || 1)));
      kInput.value = value; state.topK = value; drawHeadView();
    });
    kLabel.appendChild(kInput);
    controls.appendChild(kLabel);

    var headBox = el("span", { class: "heads", id: "head-picker" });
    headBox.appendChild(el("span", { class: "caption" }, "heads"));
    heads.forEach(function (head, position) {
      var chip = el("label", { class: "head-chip", title: "head " + head });
      var box = el("input", { type: "checkbox", class: "head-toggle", "data-head": head });
      box.checked = state.selected[position];
      box.addEventListener("change", function () { state.selected[position] = box.checked; drawHeadView(); markMatrices(); });
      var swatch = el("span", { class: "swatch" });
      swatch.style.background = headColour(position, heads.length);
      chip.appendChild(box); chip.appendChild(swatch); chip.appendChild(document.createTextNode(String(head)));
      headBox.appendChild(chip);
    });
    var all = el("button", { type: "button", id: "heads-all" }, "all");
    all.addEventListener("click", function () { setHeads(function () { return true; }); });
    var none = el("button", { type: "button", id: "heads-none" }, "none");
    none.addEventListener("click", function () { setHeads(function () { return false; }); });
    headBox.appendChild(all); headBox.appendChild(none);
    controls.appendChild(headBox);
  }
  function setHeads(choose) {
    state.selected = heads.map(function (_, position) { return choose(position); });
    controls.querySelectorAll("input.head-toggle").forEach(function (box, position) { box.checked = state.selected[position]; });
    drawHeadView(); markMatrices();
  }

  /* ------------------------------------------------------------ the head view */

  /* the keys drawn: every key, or (top-k) those some drawn row sends a line to */
  function edgesFor(now, mode, onlyRow) {
    var att = now.attention, b = Math.min(state.batch, att.B - 1);
    var queryTokens = tokensOf(now.source.queries, b);
    var edges = [];
    var used = new Set();
    heads.forEach(function (head, h) {
      if (!state.selected[h]) return;
      for (var r = 0; r < att.R; r++) {
        if (onlyRow !== null && r !== onlyRow) continue;
        var query = queryTokens[now.source.rows[r]];
        if (query && query.pad) continue; /* a padding row: its weights are noise, no lines */
        var weights = att.row(b, h, r);
        var largest = att.rowMax(b, h, r);
        if (!(largest > 0)) continue;
        if (mode === "all") {
          for (var k = 0; k < att.K; k++) {
            if (weights[k] >= 0.002) edges.push({ h: h, r: r, k: k, w: weights[k], o: Math.sqrt(weights[k]) });
          }
        } else {
          topIndices(weights, state.topK).forEach(function (k) {
            if (weights[k] > 0) { edges.push({ h: h, r: r, k: k, w: weights[k], o: Math.sqrt(weights[k] / largest) }); used.add(k); }
          });
        }
      }
    });
    var keys = mode === "all" ? range(att.K) : Array.from(used).sort(function (x, y) { return x - y; });
    return { edges: edges, keys: keys };
  }

  /* the k largest weights' positions, strongest first (ties: the earlier key) */
  function topIndices(weights, k) {
    var best = [];
    for (var i = 0; i < weights.length; i++) {
      var w = weights[i];
      if (best.length === k && w <= weights[best[k - 1]]) continue;
      var at = best.length;
      while (at > 0 && weights[best[at - 1]] < w) at--;
      best.splice(at, 0, i);
      if (best.length > k) best.pop();
    }
    return best;
  }

  /* positions with "⋮" between those that are not neighbours: [{pos} | {gap: [a, b]}] */
  function withGaps(positions, total) {
    var slots = [];
    var previous = -1;
    positions.forEach(function (p) {
      if (p > previous + 1) slots.push({ gap: [previous + 1, p - 1] });
      slots.push({ pos: p });
      previous = p;
    });
    if (total !== undefined && previous < total - 1) slots.push({ gap: [previous + 1, total - 1] });
    return slots;
  }

  /* each slot's centre along a column, gaps shorter than tokens; and the column's length */
  function slotCentres(slots) {
    var centres = [], at = 0;
    slots.forEach(function (slot) {
      var size = slot.gap ? ROW * 0.75 : ROW;
      centres.push(at + size / 2);
      at += size;
    });
    return { centres: centres, length: Math.max(at, ROW) };
  }

  function drawHeadView() {
    var now = current();
    var source = now.source, att = now.attention;
    var b = Math.min(state.batch, att.B - 1);
    var queryTokens = tokensOf(source.queries, b), keyTokens = tokensOf(source.keys, b);
    var mode = edgeMode();
    var drawn = edgesFor(now, mode, null);
    if (mode === "topk" && drawn.keys.length > KEY_COLUMN_LIMIT) {
      /* too many keys for one picture: one query row at a time (hover a query to pick it) */
      if (state.row === null || state.row >= att.R) state.row = 0;
      mode = "row";
      drawn = edgesFor(now, "topk", state.row);
    }
    var querySlots = withGaps(source.rows, queryTokens.length);
    var keySlots = withGaps(drawn.keys, keyTokens.length);
    var querySet = new Set(source.rows);
    var queryColumn = slotCentres(querySlots), keyColumn = slotCentres(keySlots);
    var length = Math.max(queryColumn.length, keyColumn.length);
    var height = length + 40;
    var labelWidth = 150, gapWidth = 300;
    var width = labelWidth * 2 + gapWidth + 40;
    var svg = svgEl("svg", { class: "head-view", id: "head-view", width: width, height: height, viewBox: "0 0 " + width + " " + height,
      "data-mode": mode, "data-source": source.id, "data-layer": now.block.layer, "data-batch": b, role: "img" });
    var leftX = labelWidth + 10, rightX = leftX + gapWidth;
    var queryY = {}, keyY = {};
    svg.appendChild(svgEl("text", { class: "side", x: leftX - 8, y: 12, "text-anchor": "end" }, source.querySide));
    svg.appendChild(svgEl("text", { class: "side", x: rightX + 8, y: 12 }, source.keySide));
    var lines = svgEl("g", { class: "edges" });
    svg.appendChild(lines);
    var generatedQuery = generatedFrom(source, source.querySide, b), generatedKey = generatedFrom(source, source.keySide, b);
    var queryNotes = pieceNotes(queryTokens), keyNotes = pieceNotes(keyTokens);
    var backgrounds = {};

    function tokenText(side, slot, index, column, tokens, notes, generatedAt) {
      var right = side === "key";
      var y = 30 + column.centres[index] * (length / column.length);
      if (slot.gap) {
        var missing = slot.gap[1] - slot.gap[0] + 1;
        var gapText = "\u22ee " + missing + (right ? " key" : " row") + (missing > 1 ? "s" : "") + " not drawn";
        svg.appendChild(svgEl("text", { class: "gap", x: right ? rightX + 8 : leftX - 8, y: y, "text-anchor": right ? "start" : "end" }, gapText));
        return;
      }
      var token = tokens[slot.pos] || { text: "?" };
      var classes = "token " + side + (token.pad ? " pad" : "") + (slot.pos >= generatedAt ? " generated" : "") +
        (mode === "row" && !right && slot.pos === source.rows[state.row] ? " current" : "");
      var label = slot.pos + " " + (token.pad ? "pad" : tokenLabel(token, 12));
      /* one group a token: its tooltip, its shading and its label */
      var group = svgEl("g", { class: "token-slot", "data-side": side, "data-pos": slot.pos });
      group.appendChild(svgEl("title", null, (right ? "key " : "query ") + slot.pos + ": " + tokenLabel(token) +
        (notes[slot.pos] ? " (" + notes[slot.pos] + ")" : "") + (token.pad ? " (padding)" : "")));
      var bg = svgEl("rect", { class: "token-bg", x: right ? rightX + 2 : leftX - labelWidth, y: y - ROW / 2 + 1, width: labelWidth - 4, height: ROW - 2, rx: 3, "fill-opacity": 0,
        "data-side": side, "data-pos": slot.pos });
      group.appendChild(bg);
      group.appendChild(svgEl("text", { class: classes, x: right ? rightX + 8 : leftX - 8, y: y, "text-anchor": right ? "start" : "end", "data-side": side, "data-pos": slot.pos }, label));
      group.addEventListener("mouseenter", function () {
        if (mode === "row" && !right && source.rows.indexOf(slot.pos) !== state.row) {
          state.row = source.rows.indexOf(slot.pos); /* one row at a time: draw this one's */
          drawHeadView();
          focus(side, slot.pos);
          return;
        }
        if (!state.pinned) focus(side, slot.pos);
      });
      group.addEventListener("mouseleave", function () { if (!state.pinned) focus(null); });
      group.addEventListener("click", function () {
        if (state.pinned && state.focus && state.focus.side === side && state.focus.pos === slot.pos) { state.pinned = false; focus(null); }
        else { state.pinned = true; focus(side, slot.pos); }
      });
      svg.appendChild(group);
      (right ? keyY : queryY)[slot.pos] = y;
      backgrounds[side + slot.pos] = bg;
    }
    querySlots.forEach(function (slot, i) { tokenText("query", slot, i, queryColumn, queryTokens, queryNotes, generatedQuery); });
    keySlots.forEach(function (slot, i) { tokenText("key", slot, i, keyColumn, keyTokens, keyNotes, generatedKey); });

    /* each head's lines a little apart, so that heads on the same pair of tokens both show */
    var picked = heads.filter(function (_, h) { return state.selected[h]; }).length;
    var spread = Math.min(2.5, (ROW - 8) / Math.max(picked, 1));
    var offsets = {}, order = 0;
    heads.forEach(function (_, h) { if (state.selected[h]) offsets[h] = (order++ - (picked - 1) / 2) * spread; });
    drawn.edges.forEach(function (edge) {
      var query = source.rows[edge.r];
      if (!querySet.has(query) || keyY[edge.k] === undefined) return;
      var shift = offsets[edge.h] || 0;
      lines.appendChild(svgEl("line", { class: "edge", x1: leftX, y1: (queryY[query] + shift).toFixed(1), x2: rightX, y2: (keyY[edge.k] + shift).toFixed(1),
        stroke: headColour(edge.h, heads.length), "stroke-opacity": Math.max(0, Math.min(1, edge.o)).toFixed(3),
        "data-h": heads[edge.h], "data-q": query, "data-k": edge.k, "data-w": edge.w.toFixed(4) }));
    });
    var wrap = headView.querySelector(".head-view-wrap");
    wrap.textContent = "";
    wrap.appendChild(svg);
    var note = headView.querySelector(".note");
    note.textContent = (mode === "all" ? "Every key; a line's opacity is the square root of its weight, as the matrices' shading (lines under 0.002 left out)." :
      mode === "row" ? "Query row " + source.rows[state.row] + ": its " + state.topK + " strongest keys per head (of " + att.K.toLocaleString("en-US") +
        "); a line's opacity is \u221a(weight \u00f7 the row's largest). Too many keys for every row at once: hover a query to draw its row." :
      "Each row's " + state.topK + " strongest keys per head; a line's opacity is \u221a(weight \u00f7 the row's largest).") +
      (source.rows.length < queryTokens.length ? " Only the computed query rows (--rows) are drawn." : "") +
      " Hover a token to isolate its row (query) or column (key); click to pin.";
    var paddingRows = source.rows.some(function (pos) { return queryTokens[pos] && queryTokens[pos].pad; });
    if (paddingRows) note.textContent += " Padding query rows draw no lines (their weights mean nothing).";
    drawLegend(source, queryTokens, keyTokens, generatedQuery, generatedKey);
    headView.backgrounds = backgrounds;
    state.focus = null;
    state.pinned = false;
    focusTable(null);
    readout("");
  }

  /* the legend of what this view marks: generated tokens, padding; nothing that is not there */
  function drawLegend(source, queryTokens, keyTokens, generatedQuery, generatedKey) {
    var legend = headView.querySelector(".legend");
    legend.textContent = "";
    var generated = source.rows.some(function (pos) { return pos >= generatedQuery && pos < queryTokens.length; }) ||
      keyTokens.length > generatedKey;
    if (generated) legend.appendChild(el("span", { class: "mark-generated" }, "generated tokens"));
    var padded = queryTokens.concat(keyTokens).some(function (t) { return t && t.pad; });
    if (padded) legend.appendChild(el("span", { class: "mark-pad" }, "padding (weight 0 as a key, no lines as a query)"));
    legend.hidden = !generated && !padded;
  }

  /* isolate one query row or key column: other lines hidden, the other side shaded by weight */
  function focus(side, pos) {
    var svg = document.getElementById("head-view");
    if (!svg) return;
    state.focus = side ? { side: side, pos: pos } : null;
    svg.setAttribute("data-focus", side ? side + ":" + pos : "");
    var attribute = side === "query" ? "data-q" : "data-k";
    var totals = {};
    var counts = 0;
    svg.querySelectorAll("line.edge").forEach(function (line) {
      var keep = !side || Number(line.getAttribute(attribute)) === pos;
      line.classList.toggle("hidden", !keep);
      if (side && keep) {
        var other = side === "query" ? "key" + line.getAttribute("data-k") : "query" + line.getAttribute("data-q");
        totals[other] = (totals[other] || 0) + Number(line.getAttribute("data-w"));
      }
    });
    heads.forEach(function (_, h) { if (state.selected[h]) counts++; });
    svg.querySelectorAll("text.token").forEach(function (text) {
      text.classList.toggle("focus", !!side && text.getAttribute("data-side") === side && Number(text.getAttribute("data-pos")) === pos);
    });
    var backgrounds = headView.backgrounds || {};
    Object.keys(backgrounds).forEach(function (name) {
      var value = side ? (totals[name] || 0) / Math.max(counts, 1) : 0;
      if (side && name === side + pos) value = 0.35;
      backgrounds[name].setAttribute("fill-opacity", Math.min(0.6, Math.sqrt(value) * 0.6).toFixed(3));
    });
    focusTable(side, pos);
    if (!side) { readout(""); return; }
    var now = current();
    var tokens = tokensOf(side === "query" ? now.source.queries : now.source.keys, Math.min(state.batch, now.attention.B - 1));
    readout((side === "query" ? "query row " : "key column ") + pos + " \u201c" + tokenLabel(tokens[pos] || {}) + "\u201d" +
      (counts ? ": shading = weight averaged over the " + counts + " head" + (counts > 1 ? "s" : "") + " picked" : "") + (state.pinned ? " (pinned: click again to release)" : ""));
  }
  /* the focused row's (or column's) weights as numbers: one column a head picked */
  function focusTable(side, pos) {
    var box = headView.querySelector(".focus-weights");
    if (!box) return;
    box.textContent = "";
    if (!side) {
      box.appendChild(el("p", { class: "note" }, "Hover a token to list its weights here."));
      return;
    }
    var now = current();
    var att = now.attention, source = now.source, b = Math.min(state.batch, att.B - 1);
    var picked = heads.map(function (_, h) { return h; }).filter(function (h) { return state.selected[h]; });
    if (!picked.length) return;
    var others = [];
    var keyTokens = tokensOf(source.keys, b), queryTokens = tokensOf(source.queries, b);
    if (side === "query") {
      var r = source.rows.indexOf(pos);
      if (r < 0) return;
      var rows = picked.map(function (h) { return att.row(b, h, r); });
      for (var k = 0; k < att.K; k++) others.push({ pos: k, token: keyTokens[k], values: rows.map(function (w) { return w[k]; }) });
    } else {
      source.rows.forEach(function (query, r) {
        others.push({ pos: query, token: queryTokens[query], values: picked.map(function (h) { return att.row(b, h, r)[pos]; }) });
      });
    }
    others.forEach(function (o) { o.mean = o.values.reduce(function (a, v) { return a + v; }, 0) / o.values.length; });
    var shown = others;
    var cut = others.length > FOCUS_ROWS;
    if (cut) shown = others.slice().sort(function (x, y) { return y.mean - x.mean || x.pos - y.pos; }).slice(0, FOCUS_ROWS);
    var table = el("table", { class: "data focus", id: "focus-weights" });
    var head = el("tr");
    head.appendChild(el("th", { class: "text" }, side === "query" ? "key" : "query"));
    picked.forEach(function (h) {
      var th = el("th");
      var swatch = el("span", { class: "swatch" });
      swatch.style.background = headColour(h, heads.length);
      th.appendChild(swatch);
      th.appendChild(document.createTextNode(" " + heads[h]));
      head.appendChild(th);
    });
    if (picked.length > 1) head.appendChild(el("th", null, "mean"));
    table.appendChild(head);
    shown.forEach(function (o) {
      var tr = el("tr", { class: o.token && o.token.pad ? "pad" : null });
      tr.appendChild(el("td", { class: "text" }, o.pos + " " + (o.token && o.token.pad ? "pad" : tokenLabel(o.token || {}, 14))));
      o.values.concat(picked.length > 1 ? [o.mean] : []).forEach(function (value) {
        var td = el("td", { class: value === 0 ? "masked" : null, title: value === 0 ? "masked (weight exactly 0)" : null }, weightText(value));
        td.style.background = shade(value);
        if (value > 0.45) td.style.color = "#ffffff";
        tr.appendChild(td);
      });
      table.appendChild(tr);
    });
    box.appendChild(el("h3", null, (side === "query" ? "query " : "key ") + pos + " \u201c" +
      tokenLabel((side === "query" ? queryTokens : keyTokens)[pos] || {}, 16) + "\u201d" + (cut ? ": its " + FOCUS_ROWS + " strongest" : "")));
    box.appendChild(table);
  }

  function readout(text) {
    var node = headView.querySelector(".readout");
    if (node) node.textContent = text;
  }

  /* ------------------------------------------------------------ matrices */

  function shade(weight) {
    /* white to the terminal's blue, sqrt so that small weights still show */
    var t = Math.sqrt(Math.max(0, Math.min(1, weight)));
    var r = Math.round(250 + (30 - 250) * t), g = Math.round(251 + (90 - 251) * t), bl = Math.round(255 + (210 - 255) * t);
    return "rgb(" + r + "," + g + "," + bl + ")";
  }

  /* long rows of near-uniform weights would all be white: there, each row on its own scale */
  function relativeShading(att) {
    return att.K > ALL_KEYS_LIMIT;
  }

  /* one head's matrix: computed rows × keys, binned (max) when the keys outnumber the pixels */
  function drawMatrix(canvas, att, b, h, rows, queryTokens, keyTokens, cellsWidth, labelled) {
    var K = att.K, R = att.R;
    var relative = relativeShading(att);
    var cell = Math.max(1, Math.min(CELL_MAX, Math.floor(cellsWidth / K)));
    var columns = Math.min(K, cell === 1 ? cellsWidth : K);
    var perColumn = K / columns;
    var rowHeight = Math.max(12, Math.min(CELL_MAX, cell));
    var showColumns = labelled && cell >= 12;
    var left = labelled ? 96 : 0;
    var top = showColumns ? 70 : (labelled ? 6 : 0);
    var width = left + columns * cell, height = top + R * rowHeight + (labelled ? 4 : 0);
    var ratio = window.devicePixelRatio || 1;
    canvas.width = Math.ceil(width * ratio); canvas.height = Math.ceil(height * ratio);
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    var ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, width, height);
    var masked = false;
    for (var r = 0; r < R; r++) {
      var weights = att.row(b, h, r);
      for (var c = 0; c < columns; c++) {
        var from = Math.floor(c * perColumn), to = Math.max(from + 1, Math.floor((c + 1) * perColumn));
        var value = 0;
        for (var k = from; k < to; k++) if (weights[k] > value) value = weights[k];
        if (value === 0) masked = true; /* every key of the cell exactly 0: masked, grey */
        ctx.fillStyle = value === 0 ? MASKED_FILL : shade(relative ? value / Math.max(att.rowMax(b, h, r), 1e-30) : value);
        ctx.fillRect(left + c * cell, top + r * rowHeight, cell, rowHeight);
      }
      if (r > 0 && rows[r] !== rows[r - 1] + 1) { /* rows not computed lie between */
        ctx.fillStyle = "#e0541c"; ctx.fillRect(left, top + r * rowHeight - 1, columns * cell, 2);
      }
    }
    if (!labelled) return { cell: cell, rowHeight: rowHeight, left: left, top: top, perColumn: perColumn, columns: columns, masked: masked };
    ctx.fillStyle = "#1d2330";
    ctx.font = Math.min(12, rowHeight) + "px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    if (left) {
      ctx.textAlign = "right";
      for (var q = 0; q < R; q++) {
        var token = queryTokens[rows[q]] || {};
        ctx.fillStyle = token.pad ? "#a0a6b3" : "#1d2330";
        ctx.fillText(rows[q] + " " + (token.pad ? "pad" : tokenLabel(token, 8)), left - 4, top + (q + 0.5) * rowHeight);
      }
    }
    if (showColumns) {
      ctx.textAlign = "left";
      for (var kk = 0; kk < K; kk++) {
        var key = keyTokens[kk] || {};
        ctx.save();
        ctx.translate(left + (kk + 0.5) * cell, top - 4);
        ctx.rotate(-Math.PI / 3);
        ctx.fillStyle = key.pad ? "#a0a6b3" : "#1d2330";
        ctx.fillText(key.pad ? "pad" : tokenLabel(key, 8), 0, 0);
        ctx.restore();
      }
    }
    return { cell: cell, rowHeight: rowHeight, left: left, top: top, perColumn: perColumn, columns: columns, masked: masked };
  }

  function drawMatrices() {
    var now = current();
    var att = now.attention, b = Math.min(state.batch, att.B - 1);
    var queryTokens = tokensOf(now.source.queries, b), keyTokens = tokensOf(now.source.keys, b);
    var box = matrices.querySelector(".matrices");
    box.textContent = "";
    var cellsWidth = heads.length > 4 && att.K <= 24 ? 300 : att.K > ALL_KEYS_LIMIT ? 440 : MATRIX_WIDTH;
    matrices.querySelector(".note").textContent = (relativeShading(att) ?
      "Shading: \u221a(weight \u00f7 the row's largest), each row on its own scale (" + att.K.toLocaleString("en-US") + " keys a row)." :
      "Shading: \u221a weight, white 0 to blue 1.") +
      (Math.floor(cellsWidth / att.K) < 1 ? " One pixel column holds " + Math.ceil(att.K / cellsWidth) + " keys: their largest weight." : "") +
      (now.source.rows.length < queryTokens.length ? " Only the computed query rows; an orange line marks rows left out." : "") +
      " Hover a cell to read its weight.";
    var anyMasked = false;
    heads.forEach(function (head, h) {
      var figure = el("figure", { class: "head-matrix", "data-head": head });
      var caption = el("figcaption");
      var swatch = el("span", { class: "swatch" });
      swatch.style.background = headColour(h, heads.length);
      caption.appendChild(swatch);
      caption.appendChild(document.createTextNode("head " + head));
      figure.appendChild(caption);
      var canvas = el("canvas", { class: "matrix", "data-head": head });
      var geometry = drawMatrix(canvas, att, b, h, now.source.rows, queryTokens, keyTokens, cellsWidth, true);
      anyMasked = anyMasked || geometry.masked;
      canvas.addEventListener("mousemove", function (event) {
        var bounds = canvas.getBoundingClientRect();
        var x = event.clientX - bounds.left - geometry.left, y = event.clientY - bounds.top - geometry.top;
        var r = Math.floor(y / geometry.rowHeight), c = Math.floor(x / geometry.cell);
        if (r < 0 || r >= att.R || c < 0 || c >= geometry.columns) { matrixReadout(""); return; }
        /* the pixel's keys: the largest of them, as the cell is shaded */
        var from = Math.floor(c * geometry.perColumn), to = Math.max(from + 1, Math.floor((c + 1) * geometry.perColumn));
        var weights = att.row(b, h, r), k = from;
        for (var j = from; j < to; j++) if (weights[j] > weights[k]) k = j;
        var weight = weights[k];
        matrixReadout("head " + head + " \u00b7 query " + now.source.rows[r] + " \u201c" + tokenLabel(queryTokens[now.source.rows[r]] || {}) +
          "\u201d \u2192 key " + k + " \u201c" + tokenLabel(keyTokens[k] || {}) + "\u201d: " + (weight === 0 ? "masked (weight exactly 0)" : weightText(weight)) +
          (to - from > 1 ? " (one pixel: keys " + from + "\u2013" + (to - 1) + ", their largest shown)" : ""));
      });
      canvas.addEventListener("mouseleave", function () { matrixReadout(""); });
      figure.appendChild(canvas);
      box.appendChild(figure);
    });
    if (anyMasked) matrices.querySelector(".note").textContent += " Grey: masked keys (weight exactly 0).";
    markMatrices();
  }
  function matrixReadout(text) {
    matrices.querySelector(".readout").textContent = text;
  }
  function markMatrices() {
    matrices.querySelectorAll("figure.head-matrix").forEach(function (figure, h) {
      figure.classList.toggle("off", !state.selected[h]);
    });
  }

  /* ------------------------------------------------------------ the model view */

  function drawModelView() {
    var now = current();
    var blocks = now.source.blocks;
    if (blocks.length < 2) { modelView.hidden = true; return; }
    modelView.hidden = false;
    var table = modelView.querySelector("table");
    table.textContent = "";
    var head = el("tr");
    head.appendChild(el("th"));
    heads.forEach(function (h) { head.appendChild(el("th", null, "head " + h)); });
    table.appendChild(head);
    var b = Math.min(state.batch, now.attention.B - 1);
    blocks.forEach(function (block, index) {
      var row = el("tr");
      row.appendChild(el("th", null, "block " + block.layer));
      heads.forEach(function (headNumber, h) {
        var cell = el("td");
        var canvas = el("canvas", { class: "cell" + (index === state.block && state.selected[h] ? " current" : ""), "data-layer": block.layer, "data-head": headNumber,
          title: "block " + block.layer + ", head " + headNumber + ": show it in the head view" });
        drawThumb(canvas, block.attention, b, h);
        canvas.addEventListener("click", function () {
          state.block = index;
          state.selected = heads.map(function (_, position) { return position === h; });
          redraw(true);
          headView.scrollIntoView({ block: "start" });
        });
        cell.appendChild(canvas);
        row.appendChild(cell);
      });
      table.appendChild(row);
    });
  }
  function drawThumb(canvas, att, b, h) {
    var size = THUMB, ratio = window.devicePixelRatio || 1;
    canvas.width = size * ratio; canvas.height = size * ratio;
    canvas.style.width = size + "px"; canvas.style.height = size + "px";
    var ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    ctx.fillStyle = "#ffffff"; ctx.fillRect(0, 0, size, size);
    var rows = Math.min(att.R, size), columns = Math.min(att.K, size);
    var cw = size / columns, rh = size / rows;
    for (var y = 0; y < rows; y++) {
      var r0 = Math.floor(y * att.R / rows), r1 = Math.max(r0 + 1, Math.floor((y + 1) * att.R / rows));
      var best = new Float32Array(columns);
      for (var r = r0; r < r1; r++) {
        var weights = att.row(b, h, r);
        for (var x = 0; x < columns; x++) {
          var k0 = Math.floor(x * att.K / columns), k1 = Math.max(k0 + 1, Math.floor((x + 1) * att.K / columns));
          var scale = relativeShading(att) ? 1 / Math.max(att.rowMax(b, h, r), 1e-30) : 1;
          for (var k = k0; k < k1; k++) if (weights[k] * scale > best[x]) best[x] = weights[k] * scale;
        }
      }
      for (var xx = 0; xx < columns; xx++) {
        ctx.fillStyle = shade(best[xx]);
        ctx.fillRect(xx * cw, y * rh, Math.ceil(cw), Math.ceil(rh));
      }
    }
  }

  /* ------------------------------------------------------------ tables */

  function dataTable(id, headings, rows, textColumns) {
    var table = el("table", { class: "data", id: id });
    var head = el("tr");
    headings.forEach(function (name, i) { head.appendChild(el("th", { class: textColumns.indexOf(i) >= 0 ? "text" : null }, name)); });
    table.appendChild(head);
    rows.forEach(function (cells) {
      var tr = el("tr", { class: cells.rowClass || null });
      if (cells.gap) {
        tr.appendChild(el("td", { colspan: headings.length }, cells.gap));
      } else {
        cells.forEach(function (value, i) { tr.appendChild(el("td", { class: textColumns.indexOf(i) >= 0 ? "text" : null }, value)); });
      }
      table.appendChild(tr);
    });
    return table;
  }

  function drawStats() {
    var now = current();
    var stats = now.block.stats;
    var box = statsSection.querySelector(".body");
    box.textContent = "";
    if (!isList(stats) || !stats.length) {
      box.appendChild(el("p", { class: "note" }, "No head statistics for this attention in the document."));
      return;
    }
    var b = Math.min(state.batch, now.attention.B - 1);
    var shown = stats.filter(function (s) { return s.batch_row === undefined || s.batch_row === null || s.batch_row === b; });
    var rows = shown.map(function (s) {
      return [String(s.head), s.kind || "", typeof s.entropy_fraction === "number" ? Math.round(s.entropy_fraction * 100) + "%" : "\u2014",
        (s.top_key === undefined ? "" : s.top_key + " ") + tokenLabel({ text: s.top_key_text }, 12),
        fixed(s.previous, 2), fixed(s.first, 2), fixed(s.diagonal, 2), fixed(s.same_token, 2), fixed(s.induction, 2)];
    });
    box.appendChild(dataTable("head-stats", ["head", "kind", "entropy", "top key", "prev", "first", "diag", "same", "induct"], rows, [1, 3]));
    box.appendChild(el("p", { class: "note" }, "entropy: of the most possible (100% = uniform); prev = i\u22121, first = key 0, diag = itself, same = earlier copies, induct = the token after an earlier copy"));
  }

  function tokenRows(tokens, positions, generatedAt) {
    var notes = pieceNotes(tokens);
    var rows = [];
    withGaps(positions, tokens.length).forEach(function (slot) {
      if (slot.gap) { rows.push({ gap: "\u22ee tokens " + slot.gap[0] + "\u2013" + slot.gap[1] + " not listed" }); return; }
      var t = tokens[slot.pos];
      var cells = [String(slot.pos), String(t.id), tokenLabel(t), t.pad ? "\u2014" : t.start + ":" + t.end,
        t.pad ? "padding: weight 0 as a key" : (slot.pos >= generatedAt ? "generated" : "") + (notes[slot.pos] ? (slot.pos >= generatedAt ? ", " : "") + notes[slot.pos] : "")];
      cells.rowClass = t.pad ? "pad" : slot.pos >= generatedAt ? "generated" : null;
      rows.push(cells);
    });
    return rows;
  }
  function drawTokens() {
    var now = current();
    var b = Math.min(state.batch, now.attention.B - 1);
    var box = tokensSection.querySelector(".body");
    box.textContent = "";
    var queryTokens = tokensOf(now.source.queries, b), keyTokens = tokensOf(now.source.keys, b);
    var columns = el("div", { class: "columns" });
    var left = el("div", { class: "scroll" });
    var twoSides = now.source.keys !== now.source.queries;
    if (twoSides) left.appendChild(el("h3", null, now.source.querySide + " tokens"));
    left.appendChild(dataTable("tokens", ["pos", "id", "token", "chars", "note"], tokenRows(queryTokens, now.source.rows, generatedFrom(now.source, now.source.querySide, b)), [2, 4]));
    columns.appendChild(left);
    if (twoSides) {
      var right = el("div", { class: "scroll" });
      right.appendChild(el("h3", null, now.source.keySide + " tokens"));
      right.appendChild(dataTable("key-tokens", ["pos", "id", "token", "chars", "note"], tokenRows(keyTokens, range(keyTokens.length), generatedFrom(now.source, now.source.keySide, b)), [2, 4]));
      columns.appendChild(right);
    }
    box.appendChild(columns);
  }

  function stageSection() {
    var groups = [];
    if (isList(doc.stages)) groups.push([isList(doc.layers) ? "stages (block 0's, as planned" + (isList(doc.prompt_tokens) ? ", over the prompt" : "") + ": the embeddings, then block 0; a later block starts from the hidden states)" : "stages", doc.stages]);
    if (isList(doc.encoder_stages)) groups.push(["encoder stages", doc.encoder_stages]);
    if (isList(doc.decoder_stages)) groups.push(["decoder stages (the whole target at once)", doc.decoder_stages]);
    if (!groups.length) return null;
    var section = el("section", { id: "stages-section" });
    groups.forEach(function (group, index) {
      section.appendChild(el("h2", null, group[0]));
      var rows = group[1].map(function (s, i) {
        return [String(i), s.name, isList(s.dims) ? s.dims.join(" ") : "", isList(s.shape) ? "(" + s.shape.join(", ") + ")" : "", s.dtype || "",
          s.device || "", s.view_of ? "view of " + s.view_of : formatBytes(s.bytes)];
      });
      section.appendChild(dataTable(index ? "stages-" + index : "stages", ["#", "stage", "dims", "shape", "dtype", "device", "bytes"], rows, [1, 2, 3, 4, 5]));
    });
    return section;
  }

  function memorySection() {
    var rows = [];
    var names = {
      parameters: "parameters", parameters_bytes: "parameters (bytes)", activation_bytes: "activations, all stages",
      attention_matrix_bytes: "one B\u00b7H\u00b7L\u00b7L matrix", scores_bytes: "scores", weights_bytes: "weights",
      peak_activation_bytes: "peak activations", peak_bytes: "peak (parameters + activations)", peak_stage: "peak at stage",
      encoder_peak_activation_bytes: "encoder peak activations (block 0)", decoder_peak_activation_bytes: "decoder peak activations (block 0, the whole target)",
      kv_cache_bytes: "decoder self-attention KV cache", cross_kv_cache_bytes: "cross-attention K and V (from the source)"
    };
    if (isList(doc.source_tokens)) names.peak_bytes = "peak (parameters + the larger of the encoder's and the decoder's with both caches)";
    var memory = doc.memory && typeof doc.memory === "object" ? doc.memory : {};
    Object.keys(memory).forEach(function (key) {
      var value = memory[key];
      if (value === null || value === undefined) return;
      var shown = key === "parameters" ? value.toLocaleString("en-US") : typeof value === "number" ? formatBytes(value) : String(value);
      rows.push([names[key] || key, shown, typeof value === "number" && key !== "parameters" ? value.toLocaleString("en-US") + " B" : ""]);
    });
    var caches = isList(doc.source_tokens) ? "KV caches at the end (self + cross, " : "KV cache at the end (";
    if (typeof doc.kv_cache_bytes === "number") rows.push([caches + "estimate)", formatBytes(doc.kv_cache_bytes), doc.kv_cache_bytes.toLocaleString("en-US") + " B"]);
    if (typeof doc.measured_kv_cache_bytes === "number") rows.push([caches + "measured)", formatBytes(doc.measured_kv_cache_bytes), doc.measured_kv_cache_bytes.toLocaleString("en-US") + " B"]);
    if (!rows.length) return null;
    var section = el("section", { id: "memory-section" });
    section.appendChild(el("h2", null, "memory"));
    section.appendChild(dataTable("memory", ["", "size", "bytes"], rows, [0]));
    return section;
  }

  function stepsSection() {
    if (!isList(doc.steps) || !doc.steps.length) return null;
    var section = el("section", { id: "steps-section" });
    section.appendChild(el("h2", null, "generation steps"));
    var rows = doc.steps.map(function (s) {
      var texts = isList(s.text) ? s.text.map(function (t) { return tokenLabel({ text: t }, 16); }).join(" | ") : "";
      return [String(s.step), texts, String(s.position), isList(s.kv_cache_shape) ? "(" + s.kv_cache_shape.join(", ") + ")" : "",
        typeof s.kv_cache_bytes === "number" ? formatBytes(s.kv_cache_bytes) : ""];
    });
    var scroll = el("div", { class: "scroll" });
    scroll.appendChild(dataTable("steps", ["step", "token", "position", "KV cache", "KV bytes"], rows, [1]));
    section.appendChild(scroll);
    return section;
  }

  function alignmentSection() {
    if (!isList(doc.alignment) || !isList(doc.source_tokens)) return null;
    var section = el("section", { id: "alignment-section" });
    section.appendChild(el("h2", null, "alignment (each generated token's strongest source token)"));
    doc.alignment.forEach(function (row, b) {
      var source = tokensOf(doc.source_tokens, b), target = tokensOf(doc.target_tokens, b);
      var rows = row.map(function (a) {
        return [String(a.target_position), tokenLabel(target[a.target_position] || {}), String(a.source_position), tokenLabel(source[a.source_position] || {}), fixed(a.weight, 2)];
      });
      if (doc.alignment.length > 1) section.appendChild(el("h2", null, "text " + b));
      var scroll = el("div", { class: "scroll" });
      scroll.appendChild(dataTable(b ? "alignment-" + b : "alignment", ["target", "token", "source", "token", "weight"], rows, [1, 3]));
      section.appendChild(scroll);
    });
    return section;
  }

  /* ------------------------------------------------------------ the page */

  function redraw(rebuildControls) {
    if (rebuildControls) buildControls();
    else {
      var layerSelect = document.getElementById("layer-select");
      if (layerSelect) layerSelect.value = String(state.block);
    }
    state.pinned = false;
    drawHeadView();
    drawMatrices();
    drawModelView();
    drawStats();
    drawTokens();
  }

  function section(id, title, extra) {
    var node = el("section", { id: id });
    node.appendChild(el("h2", null, title));
    if (extra) extra.forEach(function (child) { node.appendChild(child); });
    return node;
  }

  function build() {
    root.appendChild(summary());
    if (!sources.length) {
      root.appendChild(el("p", { class: "note" }, "The document holds no attention weights."));
    } else {
      controls = el("nav", { class: "controls", id: "controls" });
      root.appendChild(controls);
      var legend = el("span", { class: "legend" }); /* filled by drawLegend, per view */
      var pair = el("div", { class: "head-view-pair" });
      pair.appendChild(el("div", { class: "head-view-wrap" }));
      pair.appendChild(el("div", { class: "focus-weights" }));
      headView = section("head-view-section", "head view", [legend, pair, el("div", { class: "readout" }), el("p", { class: "note" })]);
      root.appendChild(headView);
      modelView = section("model-view", "model view: every block \u00d7 every head (click one to show it above)", [el("div", { class: "scroll" })]);
      modelView.querySelector(".scroll").appendChild(el("table", { class: "model-grid" }));
      root.appendChild(modelView);
      matrices = section("matrices-section", "each head's weights (rows = queries, columns = keys)", [el("p", { class: "note" }), el("div", { class: "matrices" }), el("div", { class: "readout" })]);
      root.appendChild(matrices);
      statsSection = section("stats-section", "head statistics", [el("div", { class: "body" })]);
      root.appendChild(statsSection);
      tokensSection = section("tokens-section", "tokens", [el("div", { class: "body" })]);
      root.appendChild(tokensSection);
    }
    [alignmentSection(), stepsSection(), stageSection(), memorySection()].forEach(function (node) { if (node) root.appendChild(node); });
    if (sources.length) redraw(true);
    document.documentElement.setAttribute("data-ready", "1");
  }

  build();
})();
