// "Parallel plan" TensorBoard dashboard (reports/plugin.py serves it and its data).
// Plain JavaScript, no dependencies, no network beyond this plugin's own routes.

const COLORS = ['#4285f4', '#34a853', '#fbbc05', '#ea4335', '#ab47bc', '#00acc1',
                '#ff7043', '#9e9d24', '#5c6bc0', '#f06292'];
const PARTS = ['compute_s', 'communication_s', 'bubble_s', 'recompute_s', 'optimizer_s',
               'overhead_s'];
const SVG = 'http://www.w3.org/2000/svg';

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  Object.entries(attrs).forEach(([k, v]) => node.setAttribute(k, v));
  children.forEach((c) => node.append(c));
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  Object.entries(attrs).forEach(([k, v]) => node.setAttribute(k, v));
  return node;
}

function seconds(s) {
  if (s >= 1) return s.toFixed(2) + ' s';
  if (s >= 1e-3) return (s * 1e3).toFixed(2) + ' ms';
  return (s * 1e6).toFixed(1) + ' us';
}

function bytes(n) {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return n.toFixed(i ? 2 : 0) + ' ' + units[i];
}

function tflops(t) {
  return t >= 100 ? t.toFixed(0) : t.toPrecision(3);
}

function percent(x) {
  if (x === undefined || x === null) return '-';
  return x >= 0.01 ? (100 * x).toFixed(1) + '%' : (100 * x).toPrecision(2) + '%';
}

async function getJson(url) {
  const response = await fetch(url);
  if (!response.ok) {  // the plugin answers {"error": why}; say that, not just the status
    const body = await response.json().catch(() => ({}));
    throw new Error(body.error || `${url}: HTTP ${response.status}`);
  }
  return response.json();
}

// Words of ``text`` in lines of at most ``n`` characters (a long word stays whole).
function wrap(text, n) {
  const lines = [''];
  text.split(' ').forEach((word) => {
    const last = lines[lines.length - 1];
    if (last && last.length + 1 + word.length > n) lines.push(word);
    else lines[lines.length - 1] = last ? `${last} ${word}` : word;
  });
  return lines;
}

function breakdownBars(plans) {
  // the whole name, wrapped: names that share their first 40 characters stay apart
  const width = 900, left = 380, lineH = 14;
  const names = plans.map((p) => wrap(p.name, 52));
  const rows = names.map((lines) => Math.max(26, lines.length * lineH + 10));
  const tops = rows.map((_, i) => rows.slice(0, i).reduce((x, y) => x + y, 0));
  const longest = Math.max(...plans.map((p) => p.predicted.step_time_s), 1e-12);
  const height = tops.length ? tops[tops.length - 1] + rows[rows.length - 1] : 0;
  const box = svg('svg', {width, height: height + 24, class: 'breakdown'});
  plans.forEach((p, i) => {
    const mid = tops[i] + rows[i] / 2;
    const label = svg('text', {x: 0, y: mid - (names[i].length - 1) * lineH / 2 + 4,
                               'font-size': 12});
    names[i].forEach((line, k) => {
      const span = svg('tspan', {x: 0, dy: k ? lineH : 0});
      span.textContent = line;
      label.append(span);
    });
    box.append(label);
    let x = left;
    PARTS.forEach((part, k) => {
      const w = (width - left - 80) * (p.predicted.breakdown[part] || 0) / longest;
      const r = svg('rect', {x, y: mid - 9, width: Math.max(0, w), height: 18,
                             fill: COLORS[k]});
      const title = svg('title');
      title.textContent = `${part}: ${seconds(p.predicted.breakdown[part] || 0)}`;
      r.append(title);
      box.append(r);
      x += w;
    });
    const total = svg('text', {x: x + 4, y: mid + 4, 'font-size': 12});
    total.textContent = seconds(p.predicted.step_time_s);
    box.append(total);
  });
  PARTS.forEach((part, k) => {
    const key = svg('text', {x: left + k * 90, y: height + 18, 'font-size': 11,
                             fill: COLORS[k]});
    key.textContent = part.replace('_s', '');
    box.append(key);
  });
  return box;
}

// About five round ticks from 0 to top: steps of 1, 2 or 5 times a power of ten of
// ``unit`` (bytes: a GiB or a MiB, so that the labels read 10 GiB, 20 GiB, ...).
function axisTicks(top, unit = 1) {
  const raw = top / unit / 5;
  const power = 10 ** Math.floor(Math.log10(raw || 1));
  const step = [1, 2, 5, 10].find((m) => m * power >= raw) * power * unit;
  const ticks = [];
  for (let v = 0; v <= top * (1 + 1e-9); v += step) ticks.push(v);
  return ticks;
}

function byteUnit(top) {
  return top >= 2 ** 30 ? 2 ** 30 : top >= 2 ** 20 ? 2 ** 20 : 1;
}

// Peak memory per device of each pipeline stage (plan.stages: one group per stage, from
// analysis.json), values on the bars, a byte axis; the capacity line only when it is on
// the scale (a small model on a big device would otherwise be an empty box).
function memoryBars(plan) {
  const stages = plan.stages;
  const capacity = plan.predicted.memory_capacity_bytes;
  const largest = Math.max(1, ...stages.map((g) => g.peak_memory_bytes));
  const showCapacity = capacity <= 4 * largest;
  const top = 1.1 * Math.max(largest, showCapacity ? capacity : 0);
  const width = 760, height = 240, left = 80, bottom = 24;
  const step = (width - left - 10) / Math.max(1, stages.length);
  const box = svg('svg', {width, height: height + bottom + 20, class: 'memory'});
  const y = (n) => height - (height - 14) * n / top;
  axisTicks(top, byteUnit(top)).forEach((v) => {
    box.append(svg('line', {x1: left, x2: width, y1: y(v), y2: y(v), stroke: '#ddd'}));
    const t = svg('text', {x: 0, y: y(v) + 4, 'font-size': 11});
    t.textContent = bytes(v);
    box.append(t);
  });
  const every = Math.max(1, Math.ceil(56 / step));  // label every n-th bar where they crowd
  stages.forEach((g, i) => {
    const n = g.peak_memory_bytes, x = left + i * step + 2;
    const r = svg('rect', {x, y: y(n), width: Math.max(1, step - 4), height: height - y(n),
                           fill: n <= capacity ? COLORS[0] : COLORS[3]});
    const title = svg('title');
    title.textContent = `stage ${g.stage} (${g.devices} devices: ${g.where}): ${bytes(n)}` +
        (g.min_memory_bytes !== n ? ` (smallest ${bytes(g.min_memory_bytes)})` : '');
    r.append(title);
    box.append(r);
    if (i % every === 0) {
      const label = svg('text', {x, y: height + 16, 'font-size': 11});
      label.textContent = step >= 56 ? `stage ${g.stage}` : String(g.stage);
      box.append(label);
      if (step >= 56) {
        const value = svg('text', {x, y: Math.max(12, y(n) - 4), 'font-size': 11});
        value.textContent = bytes(n);
        box.append(value);
      }
    }
    if (step < 56 && step >= 12 && height - y(n) > 6 + 5.5 * bytes(n).length) {
      // narrow bars: the value inside, upright
      const cx = x + (step - 4) / 2 + 4, cy = height - 6;
      const value = svg('text', {x: cx, y: cy, 'font-size': Math.min(11, step - 4),
                                 fill: '#fff', transform: `rotate(-90 ${cx} ${cy})`});
      value.textContent = bytes(n);
      box.append(value);
    }
  });
  if (showCapacity) {
    box.append(svg('line', {x1: left, x2: width, y1: y(capacity), y2: y(capacity),
                            stroke: COLORS[3], 'stroke-width': 2}));
  }
  const label = svg('text', {x: left, y: height + bottom + 14, 'font-size': 12});
  label.textContent = 'peak memory per device of each pipeline stage';
  box.append(label);
  // the scale, named: linear from 0; where the capacity is off it, how far, and the
  // headroom left (reports/images.py memory_scale says the same under the PNG)
  const free = capacity - largest;
  const room = free >= 0 ? `headroom ${bytes(free)} (${(100 * free / capacity).toFixed(1)}% ` +
      'free)' : `the fullest stage is ${bytes(-free)} over`;
  const scale = el('p', {class: 'memory-scale', style: 'font-size:12px;margin:2px 0 8px'},
      showCapacity ? `Linear axis from 0; capacity ${bytes(capacity)} (red line); ${room}` +
          (free >= 0 ? ' on the fullest stage.' : '.') :
          `Linear axis from 0 to ${bytes(top)}, zoomed to the bars: the capacity, ` +
          `${bytes(capacity)}, is ${Math.round(capacity / largest).toLocaleString()}x the ` +
          `fullest stage and off this scale; ${room}.`);
  return el('div', {class: 'memory-box'}, box, scale);
}

function shortDevice(d) {
  return d.replace(/^.*\/device:/, '');
}

// The dp x tp x pp grid: a row per pipeline stage, a column per data-parallel replica
// (consecutive replicas share a column when there are many), each cell one tensor group
// named by its first device and its node(s); never a column per device.
function meshTable(plan) {
  const m = plan.mesh, s = plan.strategy;
  const shade = (nodes) => (parseInt(nodes, 10) % 2 ? '#f3f3f3' : '#fff');
  const head = el('tr', {}, el('th', {}, 'stage'), el('th', {}, 'devices (nodes)'),
      ...m.columns.map(([a, b]) => el('th', {}, a === b ? `dp ${a}` : `dp ${a}..${b}`)),
      el('th', {}, 'layers'), el('th', {}, 'peak memory'));
  const rows = m.rows.map((r) => el('tr', {},
      el('td', {style: `background:${COLORS[r.stage % 10]}33`}, `stage ${r.stage}`),
      el('td', {class: 'where'}, r.where),
      ...r.cells.map((c) => {
        const cell = el('td', {class: 'cell', style: `background:${shade(c.nodes)}`,
                               title: `${c.device}: ${c.devices} devices on node(s) ${c.nodes}`},
                        el('div', {}, shortDevice(c.device) + (m.tp > 1 ? ` ×${m.tp}` : '')),
                        el('div', {class: 'node'}, `node ${c.nodes}`));
        return cell;
      }),
      el('td', {}, String(r.layers) + (m.virtual_stages > 1 ?
          ` in ${m.virtual_stages} chunks` : '')),
      el('td', {}, bytes(r.peak_memory_bytes))));
  const caption = el('p', {class: 'mesh-caption'},
      `dp=${m.dp} × tp=${m.tp} × pp=${m.pp}` + (m.cp > 1 ? ` × cp=${m.cp}` : '') +
      ` = ${m.devices.toLocaleString()} devices on ${m.nodes} node(s) of ` +
      `${m.devices_per_node}; a cell is one data-parallel replica's tensor group of ` +
      `${s.tp} device(s) on one stage, named by its first device, with its node.` +
      (m.ep > 1 ? ` Experts are split over ep=${m.ep} neighbouring replicas (each holds ` +
       `1/${m.ep} of every mixture-of-experts layer's experts; ${m.dp / m.ep} copies of each).`
       : ''));
  return el('div', {class: 'mesh-grid'}, caption,
            el('table', {class: 'mesh', style: 'font-size:11px'}, head, ...rows));
}

// Pass colours by kind, never by micro-batch (which would repeat every few micro-batches):
// forward, backward, and the recomputed forward at the start of a backward.
const KIND_COLORS = {F: '#4285f4', B: '#34a853', R: '#fbbc05'};
const IDLE_COLOR = '#eee';

// Share of each backward slot spent recomputing the forward (the simulated backward is
// 2/3 of a micro-batch's compute + communication + recompute time; see reports/images.py).
function recomputeShare(breakdown) {
  const b = breakdown || {};
  const total = (b.compute_s || 0) + (b.communication_s || 0) + (b.recompute_s || 0);
  return total > 0 ? Math.min(1, 1.5 * (b.recompute_s || 0) / total) : 0;
}

// Stages x time, drawn at ``zoom`` times the chart's width (scrolled inside its own box).
function timelineSvg(slots, pp, zoom, share) {
  const end = Math.max(...slots.map((x) => x.end_s), 1e-12);
  const chunks = 1 + Math.max(0, ...slots.map((x) => x.chunk || 0));
  const left = 70, plotW = 890 * zoom, width = left + plotW + 10;
  const row = Math.max(8, Math.min(24, 480 / pp)), rowsH = row * pp;
  const box = svg('svg', {width, height: rowsH + 30, class: 'timeline',
                          'data-zoom': String(zoom)});
  const X = (t) => left + plotW * t / end;
  for (let s = 0; s < pp; s += 1) {
    box.append(svg('rect', {x: left, y: s * row, width: plotW, height: row - 2,
                            fill: IDLE_COLOR}));
    if (row >= 14 || s % Math.ceil(14 / row) === 0) {
      const t = svg('text', {x: 0, y: s * row + Math.min(15, row), 'font-size': 12});
      t.textContent = `stage ${s}`;
      box.append(t);
    }
  }
  slots.forEach((x) => {
    const w = Math.max(1, X(x.end_s) - X(x.start_s) - 1);
    const y = x.stage * row, h = row - 2;
    const chunk = chunks > 1 ? ` (model chunk ${x.chunk || 0})` : '';
    const title = svg('title');
    title.textContent = `${x.kind === 'F' ? 'forward' : 'backward'} of micro-batch ` +
        `${x.microbatch}${chunk} on stage ${x.stage}: ${seconds(x.start_s)} to ` +
        `${seconds(x.end_s)}` + (x.kind === 'B' && share > 0 ?
        ` (the first ${Math.round(100 * share)}% recomputes the forward)` : '');
    const r = svg('rect', {x: X(x.start_s), y, width: w, height: h,
                           fill: KIND_COLORS[x.kind] || '#999', class: `pass-${x.kind}`});
    r.append(title);
    box.append(r);
    if (x.kind === 'B' && share > 0) {
      box.append(svg('rect', {x: X(x.start_s), y, width: Math.max(1, w * share), height: h,
                              fill: KIND_COLORS.R, class: 'pass-R'}));
    }
    if (chunks > 1 && (x.chunk || 0) % 2) {  // odd model chunks: a dark band on top
      box.append(svg('rect', {x: X(x.start_s), y, width: w, height: Math.max(2, h / 6),
                              fill: '#212121', opacity: 0.6}));
    }
    const label = String(x.microbatch) + (chunks > 1 ? `.${x.chunk || 0}` : '');
    if (row >= 12 && w > 6 * label.length + 3) {
      const t = svg('text', {x: X(x.start_s) + 2, y: y + h / 2 + 4, 'font-size': 10,
                             class: 'slot-label'});
      t.textContent = label;
      box.append(t);
    }
  });
  const ticks = axisTicks(end / zoom);  // about five ticks per chart width at any zoom
  const step = ticks.length > 1 ? ticks[1] - ticks[0] : end;
  for (let t = 0; t <= end * (1 + 1e-9); t += step) {
    const x = X(t);
    box.append(svg('line', {x1: x, x2: x, y1: rowsH, y2: rowsH + 5, stroke: '#212121'}));
    const label = svg('text', {x: x > width - 60 ? x - 55 : x, y: rowsH + 18, 'font-size': 11});
    label.textContent = t ? seconds(t) : '0';
    box.append(label);
  }
  return box;
}

// The pipeline timeline: a time axis, a legend for forward / backward / recompute / idle,
// each pass labelled with its micro-batch (and model chunk, interleaved), and zoom: the
// -/+ buttons and the slider widen the time axis, which scrolls inside its own box.
function timeline(schedule, pp, breakdown) {
  // analysis.json writes each slot as a row of schedule.fields (older files: objects)
  const fields = schedule.fields || [];
  const slots = schedule.slots.map((x) => (Array.isArray(x) ?
      Object.fromEntries(fields.map((f, k) => [f, x[k]])) : x));
  const chunks = 1 + Math.max(0, ...slots.map((x) => x.chunk || 0));
  const share = recomputeShare(breakdown);
  const zooms = [1, 2, 4, 8, 16, 32];
  // start at the least zoom where the shortest pass has room for its label (at most 8x)
  const end = Math.max(...slots.map((x) => x.end_s), 1e-12);
  const shortest = Math.min(...slots.map((x) => x.end_s - x.start_s));
  let level = 0;
  while (level < 3 && 890 * zooms[level] * shortest / end < 24) level += 1;
  const scroller = el('div', {class: 'timeline-scroll',
                              style: 'overflow-x:auto; max-width:980px; border:1px solid #ddd'});
  const slider = el('input', {type: 'range', min: 0, max: zooms.length - 1, step: 1,
                              value: 0, class: 'timeline-zoom'});
  const shown = el('span', {class: 'timeline-zoom-level'}, '1x');
  const draw = () => {
    const centre = (scroller.scrollLeft + scroller.clientWidth / 2) /
        Math.max(1, scroller.scrollWidth);
    slider.value = String(level);
    shown.textContent = `${zooms[level]}x`;
    scroller.replaceChildren(timelineSvg(slots, pp, zooms[level], share));
    scroller.scrollLeft = centre * scroller.scrollWidth - scroller.clientWidth / 2;
  };
  const minus = el('button', {class: 'timeline-zoom-out', title: 'zoom out'}, '−');
  const plus = el('button', {class: 'timeline-zoom-in', title: 'zoom in'}, '+');
  minus.onclick = () => { level = Math.max(0, level - 1); draw(); };
  plus.onclick = () => { level = Math.min(zooms.length - 1, level + 1); draw(); };
  slider.oninput = () => { level = Number(slider.value); draw(); };
  const key = (color, text) => el('span', {style: 'margin-right:14px'},
      el('span', {style: `display:inline-block;width:14px;height:10px;background:${color};` +
                         'margin-right:4px'}), text);
  const legend = el('div', {class: 'timeline-legend', style: 'font-size:12px;margin:4px 0'},
      key(KIND_COLORS.F, 'forward'), key(KIND_COLORS.B, 'backward'),
      ...(share > 0 ? [key(KIND_COLORS.R, 'recompute (start of each backward)')] : []),
      key(IDLE_COLOR, 'idle (bubble)'),
      el('span', {}, 'number = micro-batch' + (chunks > 1 ?
          '.model chunk (odd chunks have a dark top band)' : '') + '; hover a pass for its times'));
  const controls = el('div', {class: 'timeline-controls', style: 'font-size:12px'},
                      'zoom ', minus, slider, plus, ' ', shown);
  scroller.append(timelineSvg(slots, pp, zooms[level], share));
  slider.value = String(level);
  shown.textContent = `${zooms[level]}x`;
  return el('div', {class: 'timeline-box'}, controls, legend, scroller);
}

// Natural order of layer names: "attn_2" before "attn_10".
const NATURAL = new Intl.Collator(undefined, {numeric: true, sensitivity: 'base'});

// The per-layer tables as the plans run them (analysis.json "layer_tables",
// reports/layer_table.py): each layer's time and memory on one device of its stage --
// split by tp, sharded by ZeRO, recomputed or not -- per pipeline stage, with the rows
// (ZeRO buffers, recomputation, margin) that make the stage's total the memory chart's.
// A filter on name or type and a top-k per stage. Older analysis files: "layers" only.
function layerTables(a) {
  const tables = a.layer_tables || [{plan: a.plan.name, stages: null, rows: null}];
  const columns = [['name', 'layer'], ['type', 'type'], ['params', 'params / device'],
                   ['flops', 'FLOPs / micro-batch'], ['time_s', 'time / micro-batch'],
                   ['state_bytes', 'state'], ['activation_bytes', 'activations'],
                   ['memory_bytes', 'memory / device']];
  const cell = (k, l) => {
    const v = l[k];
    if (v === undefined || v === null) return '-';
    if (k === 'name') return v + (l.split ? ' (split)' : '');
    if (k === 'params') return v.toLocaleString();
    if (k === 'flops') return v.toExponential(3);
    if (k === 'time_s') return seconds(v);
    if (k.endsWith('_bytes')) return bytes(v);
    return String(v);
  };
  const which = el('select', {class: 'layer-plan'}, ...tables.map((t, i) =>
      el('option', {value: String(i)}, (i ? 'compared: ' : 'chosen: ') + t.plan)));
  const filter = el('input', {type: 'search', class: 'layer-filter',
                              placeholder: 'filter: layer name or type'});
  const topk = el('select', {class: 'layer-topk'}, ...[['10', 'top 10'], ['20', 'top 20'],
      ['50', 'top 50'], ['0', 'all']].map(([v, t]) => el('option', {value: v}, t)));
  topk.value = '20';
  const stagePick = el('select', {class: 'layer-stage'});
  const body = el('div', {class: 'layer-tables'});
  let key = 'memory_bytes', descending = true;
  const rowsOf = (t) => (t.rows ? t.rows.map((r) => Object.fromEntries(
      t.fields.map((f, k) => [f, r[k]]))) : a.layers);
  const stagesOf = (t, layers) => t.stages || [...new Set(layers.map((l) => l.stage))]
      .sort((x, y) => x - y).map((s) => ({stage: s, rows: []}));
  const fillStages = () => {
    const t = tables[Number(which.value)];
    const stages = stagesOf(t, rowsOf(t));
    const keep = stagePick.value;
    stagePick.replaceChildren(el('option', {value: 'all'}, 'all stages'),
        ...stages.map((g) => el('option', {value: String(g.stage)}, `stage ${g.stage}`)));
    stagePick.value = [...stagePick.options].some((o) => o.value === keep) ? keep : 'all';
  };
  const draw = () => {
    const t = tables[Number(which.value)];
    const layers = rowsOf(t);
    const words = filter.value.trim().toLowerCase();
    const k = Number(topk.value);
    const compare = (x, y) => {
      const d = key === 'name' || key === 'type' ? NATURAL.compare(x[key], y[key]) :
          x[key] < y[key] ? -1 : x[key] > y[key] ? 1 : 0;
      return descending ? -d : d;
    };
    const head = () => el('tr', {}, ...columns.map(([c, name]) => {
      const th = el('th', {'data-key': c}, name + (c === key ? (descending ? ' ▼' : ' ▲') : ''));
      th.onclick = () => {
        descending = c === key ? !descending : c !== 'name' && c !== 'type';
        key = c;
        draw();
      };
      return th;
    }));
    const sections = stagesOf(t, layers).filter((g) => stagePick.value === 'all' ||
                                                       String(g.stage) === stagePick.value)
        .map((g) => {
          const mine = layers.filter((l) => l.stage === g.stage);
          const shown = mine.filter((l) => !words || l.name.toLowerCase().includes(words) ||
                                           String(l.type).toLowerCase().includes(words))
              .sort(compare);
          const top = k ? shown.slice(0, k) : shown;
          const sum = mine.reduce((x, l) => x + (l.memory_bytes || 0), 0);
          const n = columns.length;
          const extra = (label, value, cls) => el('tr', {class: cls},
              el('td', {colspan: String(n - 1)}, label), el('td', {}, bytes(value)));
          const rows = [head(), ...top.map((l) => el('tr', {class: 'layer-row'},
              ...columns.map(([c]) => el('td', {}, cell(c, l)))))];
          if (t.stages) {
            rows.push(extra(`all ${mine.length} layers of the stage` +
                            (top.length < mine.length ? ` (${top.length} shown)` : ''),
                            g.layers_bytes, 'stage-layers'),
                      ...g.rows.map((r) => extra(r.label, r.bytes, 'stage-extra')),
                      extra('stage total (peak per device, as the memory chart)',
                            g.total_bytes, 'stage-total'));
          } else {
            rows.push(extra(`all ${mine.length} layers (unsplit: an older analysis.json)`, sum,
                            'stage-layers'));
          }
          return el('div', {class: 'layer-stage-table'},
              el('h4', {}, `stage ${g.stage}: ${shown.length} of ${mine.length} layers match` +
                 (k && shown.length > k ? `, top ${k} by ${columns.find(([c]) => c === key)[1]}`
                     : '')),
              el('table', {class: 'layers'}, ...rows));
        });
    body.replaceChildren(...sections);
  };
  which.onchange = () => { fillStages(); draw(); };
  filter.oninput = draw;
  topk.onchange = draw;
  stagePick.onchange = draw;
  fillStages();
  draw();
  return el('div', {class: 'layers-box'},
      el('p', {class: 'layer-caption', style: 'font-size:12px'},
         'Each layer on one device of its pipeline stage as the plan runs it: split layers ' +
         '(tp) divided by tp, state sharded by the ZeRO stage over the data-parallel ' +
         'replicas, activations of the micro-batches in flight less what is recomputed. ' +
         'Click a column to sort.'),
      el('div', {class: 'layer-controls', style: 'font-size:12px'},
         which, ' ', stagePick, ' ', filter, ' ', topk),
      body);
}

async function showRun(run, container) {
  container.textContent = 'Loading...';
  const a = await getJson('./analysis?run=' + encodeURIComponent(run));
  const plan = a.plan;
  if (!plan.mesh || !plan.stages.every((g) => typeof g.peak_memory_bytes === 'number')) {
    // before issue 16 the plans listed every device; this page draws stage groups
    throw new Error('its analysis.json was written by an older plan analyze (devices ' +
                    'listed one by one, no stage groups): run plan analyze again to rewrite it');
  }
  const compare = el('div', {});
  const picked = new Set([0, 1].filter((i) => i < a.candidates.length));
  const redraw = () => {
    const plans = [...picked].sort((x, y) => x - y).map((i) => a.candidates[i]);
    // the chosen plan's memory is drawn once, below; the others' here
    compare.replaceChildren(breakdownBars(plans), ...plans.filter((p) => p.name !== plan.name)
        .map((p) => el('div', {},
        el('h4', {}, `Memory per stage: ${p.name}`), memoryBars(p))));
  };
  // every candidate with its shape and breakdown; a click on a heading sorts by it (again:
  // the other way), the rank column keeps the planner's ranking
  const br = (c, k) => c.predicted.breakdown[k];
  const shape = (c) => c.strategy;
  const columns = [
    ['#', (c, i) => i + 1, (c, i) => String(i + 1)],
    ['strategy', (c) => c.name, (c) => (c.name === plan.name ? '* ' : '') + c.name],
    ['dp', (c) => shape(c).dp, (c) => String(shape(c).dp)],
    ['tp', (c) => shape(c).tp, (c) => String(shape(c).tp)],
    ['pp', (c) => shape(c).pp, (c) => String(shape(c).pp)],
    // expert parallelism: only when some candidate splits experts (plans before it: ep 1)
    ...(a.candidates.some((c) => (shape(c).ep || 1) > 1) ?
      [['ep', (c) => shape(c).ep || 1, (c) => String(shape(c).ep || 1)]] : []),
    ['micro-batches', (c) => shape(c).num_microbatches,
     (c) => `${shape(c).num_microbatches} x ${shape(c).microbatch_size}`],
    ['step time', (c) => c.predicted.step_time_s, (c) => seconds(c.predicted.step_time_s)],
    ['compute', (c) => br(c, 'compute_s'), (c) => seconds(br(c, 'compute_s'))],
    ['comm', (c) => br(c, 'communication_s'), (c) => seconds(br(c, 'communication_s'))],
    ['bubble', (c) => br(c, 'bubble_s'), (c) => seconds(br(c, 'bubble_s'))],
    ['recompute', (c) => br(c, 'recompute_s'), (c) => seconds(br(c, 'recompute_s'))],
    ['TFLOP/s/dev', (c) => c.predicted.model_tflops_per_device,
     (c) => tflops(c.predicted.model_tflops_per_device)],
    ['MFU', (c) => c.predicted.mfu, (c) => percent(c.predicted.mfu)],
    ['peak memory', (c) => c.predicted.peak_memory_bytes,
     (c) => bytes(c.predicted.peak_memory_bytes)],
    ['fits', (c) => (c.predicted.fits ? 1 : 0), (c) => (c.predicted.fits ? 'yes' : 'NO')]];
  let order = {column: 0, descending: false};
  const candidates = el('table', {class: 'candidates'});
  const fillCandidates = () => {
    const key = columns[order.column][1];
    const rows = a.candidates.map((c, i) => [c, i]);
    rows.sort(([x, i], [y, j]) => {
      const u = key(x, i), v = key(y, j);
      const cmp = typeof u === 'string' ? NATURAL.compare(u, v) : u - v;
      return (order.descending ? -cmp : cmp) || i - j;
    });
    const head = el('tr', {}, el('th', {}, 'compare'), ...columns.map(([h], k) => {
      const th = el('th', {style: 'cursor:pointer', title: 'sort by ' + h},
                    h + (k === order.column ? (order.descending ? ' \u25bc' : ' \u25b2') : ''));
      th.onclick = () => {
        order = {column: k, descending: k === order.column ? !order.descending : false};
        fillCandidates();
      };
      return th;
    }));
    candidates.replaceChildren(head, ...rows.map(([c, i]) => {
      const box = el('input', {type: 'checkbox'});
      box.checked = picked.has(i);
      box.onchange = () => { box.checked ? picked.add(i) : picked.delete(i); redraw(); };
      return el('tr', {}, el('td', {}, box), ...columns.map(([, , text]) => el('td', {},
                                                                            text(c, i))));
    }));
  };
  fillCandidates();
  redraw();
  container.replaceChildren(
      el('h2', {}, `Chosen: ${plan.name}`),
      el('p', {class: 'summary'}, `Model ${plan.model.name} on ${plan.cluster.name}, global ` +
         `batch ${plan.global_batch}: predicted ${seconds(plan.predicted.step_time_s)} per ` +
         `step, ${plan.predicted.samples_per_s.toFixed(1)} samples/s, ` +
         `${tflops(plan.predicted.model_tflops_per_device)} model TFLOP/s per device ` +
         `(MFU ${percent(plan.predicted.mfu)}) on ${plan.devices.toLocaleString()} devices.`),
      el('p', {class: 'reason'}, plan.reason || ''),
      el('h3', {}, 'Candidates (tick to compare)'), candidates,
      el('h3', {}, 'Side by side: step time breakdown and memory'), compare,
      el('h3', {}, 'Memory per pipeline stage'), memoryBars(plan),
      el('h3', {}, 'Device mesh and placement'), meshTable(plan),
      el('h3', {}, `Pipeline schedule (${plan.strategy.schedule}, ` +
         `${a.schedule.num_microbatches} micro-batches)`),
      timeline(a.schedule, plan.strategy.pp, plan.predicted.breakdown),
      el('h3', {}, 'Layers per stage, as planned'), layerTables(a));
}

// Training runs apply.wrap(model, plan, logdir=...) measured (apply/monitor.py writes a
// training.json the plugin lists): the median measured step time against the prediction.
function trainingRuns(training) {
  const ratio = (r) => (r === null || r === undefined ? '-' : `${r.toFixed(2)}x`);
  const time = (t) => (t === null || t === undefined ? '-' : seconds(t));
  return el('div', {class: 'training-runs'},
      el('h3', {}, 'Training runs: measured against predicted'),
      el('table', {class: 'training'},
          el('tr', {}, ...['run', 'plan', 'steps measured', 'measured step time (median)',
                           'predicted', 'measured / predicted'].map((h) => el('th', {}, h))),
          ...training.map((t) => (t.error ?
              el('tr', {class: 'training-error'}, el('td', {}, t.run),
                 el('td', {colspan: '5'}, t.error)) :
              el('tr', {}, el('td', {}, t.run), el('td', {}, t.plan),
                 el('td', {}, String(t.steps)), el('td', {}, time(t.measured_step_time_s)),
                 el('td', {}, time(t.predicted_step_time_s)),
                 el('td', {class: 'training-ratio'}, ratio(t.measured_over_predicted)))))));
}

export async function render() {
  const style = el('style', {}, `
    body { font-family: Roboto, sans-serif; margin: 16px; color: #212121; }
    table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
    th, td { border: 1px solid #ddd; padding: 2px 8px; }
    th { background: #f5f5f5; cursor: pointer; }`);
  const title = el('h1', {}, 'Parallel plan');
  const selector = el('select', {class: 'run-selector'});
  const container = el('div', {class: 'run'});
  document.body.append(style, title, selector, container);
  let runs, unreadable, training;
  try {
    ({runs, unreadable = [], training = []} = await getJson('./runs'));
  } catch (e) {
    container.replaceChildren(el('p', {class: 'run-error'}, `Cannot list the runs: ${e.message}`));
    return;
  }
  if (training.length) selector.before(trainingRuns(training));
  if (!runs.length && !unreadable.length) {
    container.textContent = 'No run with a parallel plan under the logdir: run plan analyze ' +
        '--out DIR and point TensorBoard at DIR/tensorboard.';
    return;
  }
  // Runs whose analysis the plugin cannot read are listed with the reason, never loaded.
  const errors = new Map(unreadable.map((r) => [r.run, r.error]));
  runs.forEach((r) => selector.append(el('option', {value: r.run},
                                          `${r.run}: ${r.model}, ${r.plan}`)));
  unreadable.forEach((r) => selector.append(el('option', {value: r.run},
                                                `${r.run}: unreadable`)));
  if (unreadable.length) {
    container.before(el('div', {class: 'unreadable'},
        el('p', {}, `${unreadable.length} run(s) could not be read:`),
        el('ul', {}, ...unreadable.map((r) => el('li', {}, el('b', {}, r.run), `: ${r.error}`)))));
  }
  const load = async (run) => {
    const fail = (why) => container.replaceChildren(
        el('p', {class: 'run-error'}, `Run ${run} cannot be shown: ${why}`));
    if (errors.has(run)) return fail(errors.get(run));
    try {
      await showRun(run, container);
    } catch (e) {
      fail(e.message);
    }
  };
  selector.onchange = () => load(selector.value);
  await load((runs[0] || unreadable[0]).run);
}
