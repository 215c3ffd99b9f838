"""The HTML report's page: one Jinja2 template, self-contained (styles inline, charts as inline SVG).

Every number a reader may want to check carries ``data-run`` and ``data-key`` attributes and its
full-precision value in ``data-value``, so a test (or a script) reads the page back against
``summary.json``.
"""

from __future__ import annotations

TEMPLATE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>geotrain report: {{ title }}</title>
<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1150px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .92em; }
th, td { border: 1px solid #ddd; padding: .3em .6em; text-align: right; }
th:first-child, td:first-child, td.text { text-align: left; }
th { background: #f4f4f4; }
.chart svg { max-width: 100%; height: auto; }
.note { color: #555; font-size: .9em; }
details pre { background: #f8f8f8; padding: .6em; overflow-x: auto; font-size: .85em; }
nav a { margin-right: 1em; }
</style>
</head>
<body>
<h1>geotrain report: {{ title }}</h1>
<p class="note">Written {{ written }} by geotrain from {{ sources|join(", ") }}. Every number below is read from
the runs' <code>summary.json</code> and per-rank metrics; nothing on this page loads anything from a network.</p>
<nav>{% for id, name in sections %}<a href="#{{ id }}">{{ name }}</a>{% endfor %}</nav>

<section id="runs"><h2>Runs</h2>
<table>
<tr><th>run</th><th>algorithm</th><th>sites</th><th>steps</th><th>tokens</th><th>final eval loss</th>
<th>inter-site bytes</th><th>compression</th><th>wall s</th><th>utilisation (min rank)</th><th>global models identical</th></tr>
{% for r in runs %}<tr><td class="text">{{ r.label }}</td><td class="text">{{ r.algorithm }}</td><td class="text">{{ r.sites }}</td>
{{ cell(r, "steps") }}{{ cell(r, "tokens") }}{{ cell(r, "final_eval_loss", ".4f") }}{{ cell(r, "inter_site_bytes", "bytes") }}
{{ cell(r, "compression_ratio", ".2f") }}{{ cell(r, "wall_seconds", ".1f") }}{{ cell(r, "utilization", ".1%") }}
<td class="text">{{ "yes" if r.identical else "NO" }}</td></tr>
{% endfor %}</table>
{% for v in verdicts %}<p class="verdict"><strong>{{ v }}</strong></p>{% endfor %}
<h3>What differs between the runs' configs</h3>
{% if differ %}<table><tr><th>setting</th>{% for r in runs %}<th>{{ r.label }}</th>{% endfor %}</tr>
{% for key, values in differ %}<tr><td class="text">{{ key }}</td>{% for v in values %}<td class="text">{{ v }}</td>{% endfor %}</tr>
{% endfor %}</table>{% else %}<p>{{ "Nothing: the runs share one config." if runs|length > 1 else "One run." }}</p>{% endif %}
{% for r in runs %}<details><summary>config of {{ r.label }}</summary><pre>{{ r.config_yaml }}</pre></details>{% endfor %}
</section>

<section id="loss"><h2>Eval loss</h2>
<div class="chart">{{ charts.loss_tokens|safe }}</div>
<div class="chart">{{ charts.loss_wall|safe }}</div>
<p class="note">Wall time: seconds since the run's first step at each evaluation (rank 0's clock).</p>
</section>

<section id="sites"><h2>Sites over time</h2>
<p class="note">Per site (its first rank), over windows of {{ window }} steps: the share of time computing
rather than waiting on the wide-area network, and the wide-area wait per step.</p>
{% for r in runs %}<h3>{{ r.label }}</h3><div class="chart">{{ charts.sites[loop.index0]|safe }}</div>{% endfor %}
</section>

<section id="bytes"><h2>Bytes per link</h2>
<p class="note">What each site sent to the other sites (its wide-area uplinks), and inside itself; compression
is the fp32 bytes those sends stand for over the bytes sent.</p>
{% for r in runs %}<h3>{{ r.label }}</h3><table><tr><th>site</th><th>inter-site bytes sent</th><th>fp32 bytes they stand for</th>
<th>compression</th><th>intra-site bytes</th><th>utilisation</th></tr>
{% for s in r.site_rows %}<tr><td class="text">{{ s.site }}</td>{{ cell(r, "inter_site_bytes", "bytes", s, "site:" ~ s.site) }}
{{ cell(r, "inter_site_raw_bytes", "bytes", s, "site:" ~ s.site) }}{{ cell(r, "compression", ".2f", s, "site:" ~ s.site) }}
{{ cell(r, "intra_site_bytes", "bytes", s, "site:" ~ s.site) }}{{ cell(r, "utilization", ".1%", s, "site:" ~ s.site) }}</tr>
{% endfor %}</table>{% endfor %}
<div class="chart">{{ charts.bytes|safe }}</div>
</section>

<section id="rounds"><h2>Rounds</h2>
<table><tr><th>run</th><th>rounds</th><th>rolled back</th><th>committed (elastic)</th><th>split, then healed</th><th>lost sites</th><th>merges (async)</th></tr>
{% for r in runs %}<tr><td class="text">{{ r.label }}</td>{{ cell(r, "rounds") }}{{ cell(r, "rounds_rolled_back") }}
{{ cell(r, "rounds_committed") }}{{ cell(r, "rounds_split") }}<td class="text">{{ r.lost_sites }}</td>{{ cell(r, "merges") }}</tr>
{% endfor %}</table>
{% for r in runs %}{% if r.failures %}<h3>{{ r.label }}: failures and healing</h3>
<table><tr><th>site</th><th>kind</th><th>step</th><th>detected after s</th><th>left out after s</th><th>healed after s</th></tr>
{% for f in r.failures %}<tr><td class="text">{{ f.site }}</td><td class="text">{{ f.kind }}</td><td>{{ f.step }}</td><td>{{ f.detected }}</td><td>{{ f.excluded }}</td><td>{{ f.healed }}</td></tr>
{% endfor %}</table>{% endif %}{% endfor %}
</section>

<section id="guard"><h2>Guard</h2>
{% for r in runs %}<h3>{{ r.label }}</h3>
<table><tr><th>site</th><th>updates left out</th></tr>
{% for site, n in r.guard_rejections %}<tr><td class="text">{{ site }}</td>{{ cell(r, "guard_rejections", "", {"guard_rejections": n}, "site:" ~ site) }}</tr>{% endfor %}
</table>
{% if r.guard_events %}<table><tr><th>round</th><th>fragment</th><th>site</th><th>why</th></tr>
{% for e in r.guard_events %}<tr><td>{{ e.round }}</td><td>{{ e.fragment }}</td><td class="text">{{ e.site }}</td><td class="text">{{ e.why }}</td></tr>{% endfor %}
</table>{% else %}<p>No update was left out.</p>{% endif %}{% endfor %}
</section>

<section id="privacy"><h2>Privacy</h2>
<table><tr><th>run</th><th>secure aggregation</th><th>DP unit</th><th>ε spent</th><th>ε budget</th><th>δ</th><th>dropouts</th><th>stopped by the budget at step</th></tr>
{% for r in runs %}<tr><td class="text">{{ r.label }}</td><td class="text">{{ "yes" if r.secagg else "no" }}</td><td class="text">{{ r.dp_unit }}</td>
{{ cell(r, "epsilon", ".4g") }}{{ cell(r, "epsilon_budget", ".4g") }}{{ cell(r, "delta", ".2g") }}{{ cell(r, "dropouts") }}{{ cell(r, "privacy_stopped_at_step") }}</tr>
{% endfor %}</table>
{% if charts.epsilon %}<div class="chart">{{ charts.epsilon|safe }}</div>{% endif %}
</section>

<section id="checkpoints"><h2>Checkpoints</h2>
{% for r in runs %}<h3>{{ r.label }}</h3>{% if r.checkpoints %}<table><tr><th>step</th><th>folder</th><th>files</th><th>MB</th><th>manifest</th></tr>
{% for c in r.checkpoints %}<tr><td>{{ c.step }}</td><td class="text">{{ c.path }}</td><td>{{ c.files }}</td><td>{{ "%.2f"|format(c.mb) }}</td><td class="text">{{ c.manifest }}</td></tr>{% endfor %}
</table>{% else %}<p>{{ r.checkpoint_note }}</p>{% endif %}{% endfor %}
</section>

<section id="prediction"><h2>Prediction and measurement</h2>
{% for r in runs %}<h3>{{ r.label }}</h3>{% if r.predictions %}
<p class="note">sync.adapt chose each round's settings from the link it measured; the planner's predicted
utilisation for the next round beside what the round then measured.</p>
<table><tr><th>round</th><th>H</th><th>codec</th><th>predicted utilisation</th><th>measured (slowest site)</th></tr>
{% for p in r.predictions %}<tr><td>{{ p.round }}</td><td>{{ p.H }}</td><td class="text">{{ p.codec }}</td><td>{{ p.predicted }}</td><td>{{ p.measured }}</td></tr>{% endfor %}
</table>{% else %}<p>No prediction recorded: the run did not choose its settings with the planner (sync.adapt), and
it was not made by geotrain plan or place.</p>{% endif %}{% endfor %}
</section>
</body>
</html>
"""
