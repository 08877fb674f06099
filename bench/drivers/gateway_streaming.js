// The channel side of bench/gateway_streaming.sh: plays Teams (POSTs to the gateway's
// /api/messages, and a Connector stand-in that receives the gateway's drafts and replies) and
// Direct Line (a client on the conversation's WebSocket, or Web Chat 4.18 in headless Chromium),
// times what reaches the channel, and prints one JSON object on its last line of stdout (a
// human summary goes to stderr).
//
//   node gateway_streaming.js first-draft-teams  --gateway URL --turns N --concurrency C --turn-ms MS
//   node gateway_streaming.js first-draft-directline --gateway URL --secret S --turns N --concurrency C --turn-ms MS
//   node gateway_streaming.js long-teams         --gateway URL --turn-ms MS
//   node gateway_streaming.js long-webchat       --gateway URL --secret S --turn-ms MS
//                                                --puppeteer DIR --chromium PATH --webchat-js FILE --artifacts DIR
//                                                [--webchat-timeout-ms MS]
//   node gateway_streaming.js kill               --gateway URL_A --gateway-b URL_B --kill-pid PID
//                                                --turns N --turn-ms MS --runs-file FILE
//   node gateway_streaming.js redeliver          --gateway URL_A --gateway-b URL_B --to same|other
//                                                --turns N --turn-ms MS --at-ms MS --runs-file FILE
//
// Only Node 20's standard library, and the `ws` package (puppeteer-core brings it) for Direct
// Line's WebSocket: `--node-modules DIR` says where.
'use strict';

const http = require('http');
const fs = require('fs');
const path = require('path');
const { performance } = require('perf_hooks');

const [command, ...rest] = process.argv.slice(2);
const opts = {};
for (let i = 0; i < rest.length; i += 2) {
  if (!rest[i].startsWith('--')) throw new Error('unexpected argument ' + rest[i]);
  opts[rest[i].slice(2)] = rest[i + 1];
}
const num = (name, dflt) => (opts[name] === undefined ? dflt : Number(opts[name]));
const TURN_MS = num('turn-ms', 20000);
const RUN = opts.run || Math.random().toString(36).slice(2, 8);
const now = () => performance.now();
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const log = (...args) => console.error(...args);

// --- numbers ------------------------------------------------------------------------------------

/// Nearest-rank percentile of sorted `values`.
function pct(sorted, p) {
  if (sorted.length === 0) return null;
  const rank = Math.max(1, Math.ceil((p / 100) * sorted.length));
  return sorted[Math.min(rank, sorted.length) - 1];
}

function summary(values) {
  const sorted = values.filter((v) => v !== null && v !== undefined).sort((a, b) => a - b);
  const round = (v) => (v === null ? null : Math.round(v * 10) / 10);
  return {
    n: sorted.length,
    p50: round(pct(sorted, 50)),
    p90: round(pct(sorted, 90)),
    p99: round(pct(sorted, 99)),
    max: round(sorted.length ? sorted[sorted.length - 1] : null),
  };
}

function countBy(values) {
  const counts = {};
  for (const v of values) counts[v] = (counts[v] || 0) + 1;
  return counts;
}

// --- the Connector stand-in ---------------------------------------------------------------------

/// An HTTP server answering the gateway's `POST {serviceUrl}/v3/conversations/{id}/activities[/{replyToId}]`
/// with `{"id": …}`, recording each activity with the time it arrived, by conversation.
async function connector() {
  const byConversation = new Map();
  const waiters = new Map();
  let ids = 0;
  let refused = 0;
  const server = http.createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      const at = now();
      const match = /^\/v3\/conversations\/([^/]+)\/activities(?:\/([^/]+))?$/.exec(req.url);
      let activity;
      try {
        activity = JSON.parse(Buffer.concat(chunks).toString('utf8'));
      } catch (e) {
        activity = null;
      }
      if (req.method !== 'POST' || !match || !activity) {
        refused += 1;
        res.writeHead(400, { 'content-type': 'application/json' });
        res.end('{"error":{"code":"BadArgument"}}');
        return;
      }
      const conversation = decodeURIComponent(match[1]);
      const info = (activity.entities || []).find((e) => e && e.type === 'streaminfo') || null;
      ids += 1;
      const id = 'connector-' + ids;
      const event = {
        at,
        id,
        type: activity.type,
        replyTo: match[2] ? decodeURIComponent(match[2]) : null,
        streamType: info ? info.streamType : null,
        streamSequence: info ? info.streamSequence : null,
        streamId: info ? info.streamId : null,
        text: activity.text || '',
      };
      if (!byConversation.has(conversation)) byConversation.set(conversation, []);
      byConversation.get(conversation).push(event);
      res.writeHead(201, { 'content-type': 'application/json' });
      res.end(JSON.stringify({ id }));
      const waiting = waiters.get(conversation);
      if (waiting) waiting.forEach((w) => w(event));
    });
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address();
  return {
    url: `http://127.0.0.1:${port}/`,
    events: (conversation) => byConversation.get(conversation) || [],
    refused: () => refused,
    /// Resolves with the first event of `conversation` (already received or to come) that
    /// `test` accepts, or null after `ms`.
    when(conversation, test, ms) {
      const seen = (byConversation.get(conversation) || []).find(test);
      if (seen) return Promise.resolve(seen);
      return new Promise((resolve) => {
        const list = waiters.get(conversation) || [];
        const timer = setTimeout(() => done(null), ms);
        function waiter(event) {
          if (test(event)) done(event);
        }
        function done(event) {
          clearTimeout(timer);
          const i = list.indexOf(waiter);
          if (i >= 0) list.splice(i, 1);
          resolve(event);
        }
        list.push(waiter);
        waiters.set(conversation, list);
      });
    },
    close: () => new Promise((resolve) => server.close(resolve)),
  };
}

const isDraft = (e) => e.type === 'typing' && (e.streamType === 'informative' || e.streamType === 'streaming');
const isFinal = (e) => e.type === 'message';

/// A Teams one-on-one message, as the channel POSTs it to a bot.
function teamsActivity(serviceUrl, conversation, id, text) {
  return {
    type: 'message',
    id,
    timestamp: new Date().toISOString(),
    serviceUrl,
    channelId: 'msteams',
    from: { id: '29:user-' + conversation, name: 'Bench User', aadObjectId: '00000000-0000-0000-0000-000000000001' },
    conversation: { id: conversation, conversationType: 'personal', tenantId: 'bench-tenant' },
    recipient: { id: '28:bench-bot', name: 'bench-bot' },
    text,
    textFormat: 'plain',
    locale: 'en-US',
    channelData: { tenant: { id: 'bench-tenant' } },
  };
}

/// POSTs `activity` to `gateway`'s /api/messages; its HTTP status (0: no answer) and when.
async function postMessages(gateway, activity) {
  try {
    const response = await fetch(gateway + '/api/messages', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify(activity),
    });
    await response.arrayBuffer();
    return { status: response.status, at: now() };
  } catch (e) {
    return { status: 0, at: now(), error: String(e.cause || e) };
  }
}

/// One Teams turn on `gateway`: POST, then wait for the final message (at most `limit` ms) and
/// a little longer for anything after it.
async function teamsTurn(cn, gateway, conversation, id, limit) {
  const activity = teamsActivity(cn.url, conversation, id, 'count');
  const start = now();
  const posted = await postMessages(gateway, activity);
  const final = await cn.when(conversation, isFinal, limit);
  return describeTeams(cn, conversation, start, posted, final);
}

function describeTeams(cn, conversation, start, posted, final) {
  const events = cn.events(conversation);
  const drafts = events.filter(isDraft);
  const finals = events.filter(isFinal);
  return {
    conversation,
    status: posted.status,
    answeredMs: posted.at - start,
    firstDraftMs: drafts.length ? drafts[0].at - start : null,
    lastDraftMs: drafts.length ? drafts[drafts.length - 1].at - start : null,
    finalMs: final ? final.at - start : null,
    drafts: drafts.length,
    informative: drafts.filter((d) => d.streamType === 'informative').length,
    finals: finals.length,
    finalStreamType: finals.length ? finals[finals.length - 1].streamType : null,
    finalText: finals.length ? finals[finals.length - 1].text : null,
    sequences: drafts.map((d) => d.streamSequence),
  };
}

/// Runs `turns` calls of `one(i)`, `concurrency` at a time.
async function pool(turns, concurrency, one) {
  const results = new Array(turns);
  let next = 0;
  async function lane() {
    while (next < turns) {
      const i = next++;
      results[i] = await one(i);
    }
  }
  await Promise.all(Array.from({ length: Math.min(concurrency, turns) }, lane));
  return results;
}

function report(name, results, extra) {
  const errors = results.filter((r) => r.error || r.finals !== 1 || (r.status !== 202 && r.status !== 200));
  const out = {
    name,
    turns: results.length,
    firstDraftMs: summary(results.map((r) => r.firstDraftMs)),
    finalMs: summary(results.map((r) => r.finalMs)),
    answeredMs: summary(results.map((r) => r.answeredMs)),
    draftsPerTurn: summary(results.map((r) => r.drafts)),
    statuses: countBy(results.map((r) => r.status)),
    finalsPerTurn: countBy(results.map((r) => r.finals)),
    noDraft: results.filter((r) => r.firstDraftMs === null).length,
    failed: errors.length,
    ...extra,
  };
  log(`== ${name}: ${out.turns} turns`);
  log(`   first draft ms  ${JSON.stringify(out.firstDraftMs)}`);
  log(`   final ms        ${JSON.stringify(out.finalMs)}`);
  log(`   POST answered   ${JSON.stringify(out.answeredMs)}  statuses ${JSON.stringify(out.statuses)}`);
  log(`   drafts per turn ${JSON.stringify(out.draftsPerTurn)}  finals per turn ${JSON.stringify(out.finalsPerTurn)}`);
  log(`   turns without a draft ${out.noDraft}, failed ${out.failed}`);
  return out;
}

// --- Direct Line ----------------------------------------------------------------------------------

function wsClass() {
  const dir = opts['node-modules'];
  return require(dir ? path.join(dir, 'ws') : 'ws');
}

async function startConversation(gateway, secret) {
  const response = await fetch(gateway + '/v3/directline/conversations', {
    method: 'POST',
    headers: { authorization: 'Bearer ' + secret },
  });
  if (response.status !== 201 && response.status !== 200) {
    throw new Error('starting a conversation: ' + response.status + ' ' + (await response.text()));
  }
  return response.json();
}

/// One Direct Line turn: start a conversation, open its stream, POST "count", time the first
/// interim typing activity and the final message on the WebSocket, and the POST's answer.
async function directLineTurn(gateway, secret, limit) {
  const WebSocket = wsClass();
  const started = await startConversation(gateway, secret);
  const socket = new WebSocket(started.streamUrl);
  const events = [];
  let onEvent = null;
  socket.on('message', (data) => {
    const at = now();
    let group;
    try {
      group = JSON.parse(data.toString());
    } catch (e) {
      return;
    }
    for (const a of group.activities || []) {
      const info = (a.entities || []).find((e) => e && e.type === 'streaminfo') || a.channelData || {};
      const event = {
        at,
        type: a.type,
        fromBot: !!(a.from && a.from.role === 'bot'),
        streamType: info.streamType || null,
        watermark: group.watermark !== undefined,
        text: a.text || '',
      };
      events.push(event);
      if (onEvent) onEvent(event);
    }
  });
  await new Promise((resolve, reject) => {
    socket.once('open', resolve);
    socket.once('error', reject);
  });
  let settle;
  const finalSeen = new Promise((resolve) => {
    const timer = setTimeout(() => resolve(null), limit);
    settle = (e) => {
      clearTimeout(timer);
      resolve(e);
    };
    onEvent = (e) => {
      if (e.type === 'message' && e.fromBot) settle(e);
    };
  });
  const start = now();
  const posting = fetch(`${gateway}/v3/directline/conversations/${started.conversationId}/activities`, {
    method: 'POST',
    headers: { authorization: 'Bearer ' + started.token, 'content-type': 'application/json' },
    body: JSON.stringify({ type: 'message', from: { id: 'dl-bench-user' }, text: 'count' }),
  }).then(async (r) => ({ status: r.status, body: await r.text(), at: now() }),
    (e) => ({ status: 0, body: String(e.cause || e), at: now() }));
  // A failed POST: the turn's replies never reach the transcript; a second for stragglers.
  posting.then((p) => { if (p.status !== 200) sleep(1000).then(() => settle(null)); });
  const final = await finalSeen;
  const posted = await Promise.race([posting, sleep(final ? 5000 : 1000).then(() => null)]);
  await sleep(300);
  socket.close();
  const drafts = events.filter((e) => e.type === 'typing' && (e.streamType === 'informative' || e.streamType === 'streaming'));
  const finals = events.filter((e) => e.type === 'message' && e.fromBot);
  return {
    conversation: started.conversationId,
    status: posted ? posted.status : null,
    statusBody: posted && posted.status >= 400 ? posted.body.slice(0, 300) : undefined,
    answeredMs: posted ? posted.at - start : null,
    firstDraftMs: drafts.length ? drafts[0].at - start : null,
    lastDraftMs: drafts.length ? drafts[drafts.length - 1].at - start : null,
    finalMs: final ? final.at - start : null,
    drafts: drafts.length,
    finals: finals.length,
    finalStreamType: finals.length ? finals[finals.length - 1].streamType : null,
  };
}

// --- Web Chat in Chromium -----------------------------------------------------------------------

// `timeout`: Web Chat's `sendTimeout` and botframework-directlinejs' request `timeout` (both
// 20 s by default), or null for Web Chat's defaults.
function webChatPage(gateway, token, timeout) {
  return `<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Web Chat</title>
<style>html, body, #webchat { height: 100%; margin: 0; }</style></head>
<body><div id="webchat" role="main"></div>
<script src="/webchat.js"></script>
<script>
  window.seen = [];
  const directLine = window.WebChat.createDirectLine({
    domain: '${gateway}/v3/directline',
    token: ${JSON.stringify(token)},
    webSocket: true,
  });${timeout ? `\n  // createDirectLine passes no timeout on: set the client's own.\n  directLine.timeout = ${timeout};` : ''}
  directLine.connectionStatus$.subscribe((status) => { window.directLineStatus = status; });
  directLine.activity$.subscribe((a) => {
    const info = (a.entities || []).find((e) => e && e.type === 'streaminfo') || a.channelData || {};
    window.seen.push({ at: performance.now(), type: a.type, role: a.from && a.from.role,
      streamType: info.streamType || null, text: a.text || '' });
  });
  window.WebChat.renderWebChat({ directLine${timeout ? `, styleOptions: { sendTimeout: ${timeout} }` : ''} },
    document.getElementById('webchat'));
</script></body></html>`;
}

async function longWebChat() {
  const gateway = opts.gateway;
  const generated = await fetch(gateway + '/v3/directline/tokens/generate', {
    method: 'POST',
    headers: { authorization: 'Bearer ' + opts.secret, 'content-type': 'application/json' },
    body: JSON.stringify({ user: { id: 'dl_webchat_bench' } }),
  }).then((r) => r.json());
  const webChatTimeout = opts['webchat-timeout-ms'] ? Number(opts['webchat-timeout-ms']) : null;
  const html = webChatPage(gateway, generated.token, webChatTimeout);
  const bundle = fs.readFileSync(opts['webchat-js']);
  const site = http.createServer((req, res) => {
    if (req.url === '/webchat.js') {
      res.writeHead(200, { 'content-type': 'text/javascript' });
      res.end(bundle);
    } else {
      res.writeHead(200, { 'content-type': 'text/html; charset=utf-8' });
      res.end(html);
    }
  });
  await new Promise((resolve) => site.listen(0, '127.0.0.1', resolve));
  const siteUrl = `http://127.0.0.1:${site.address().port}/`;
  const puppeteer = require(opts.puppeteer);
  const browser = await puppeteer.launch({
    executablePath: opts.chromium,
    headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
  });
  const errors = [];
  const posts = [];
  let result;
  try {
    const page = await browser.newPage();
    await page.setViewport({ width: 520, height: 720 });
    page.on('pageerror', (e) => errors.push(String(e)));
    page.on('console', (m) => { if (m.type() === 'error') errors.push('console: ' + m.text()); });
    page.on('response', (r) => {
      if (r.request().method() === 'POST' && /\/activities$/.test(r.url())) {
        posts.push({ status: r.status(), at: Date.now() });
      }
    });
    await page.goto(siteUrl, { waitUntil: 'load' });
    const input = '[data-id="webchat-sendbox-input"]';
    const wait = { timeout: 30000 };
    await page.waitForSelector(input, wait);
    await page.waitForFunction(() => window.directLineStatus === 2, wait);
    // Watch the bot's bubbles: every distinct text shown, with when.
    await page.evaluate(() => {
      window.shown = [];
      const bubbles = '.webchat__bubble:not(.webchat__bubble--from-user) .webchat__bubble__content';
      let last = null;
      const look = () => {
        const all = Array.from(document.querySelectorAll(bubbles)).map((b) => b.innerText.trim());
        const key = JSON.stringify(all);
        if (key !== last) {
          last = key;
          window.shown.push({ at: performance.now(), bubbles: all });
        }
      };
      new MutationObserver(look).observe(document.body, { subtree: true, childList: true, characterData: true });
      window.sentAt = null;
    });
    await page.type(input, 'count');
    const sentAt = await page.evaluate(() => performance.now());
    const sentAtHere = performance.now();
    await page.keyboard.press('Enter');
    const limit = TURN_MS * 2 + 30000;
    const END = 'before it is committed.';
    // Until the final message arrives; after a failed POST, until the turn's own length (and
    // 5 s) has passed, in case its committed reply still shows up.
    let settled = true;
    const deadline = Date.now() + limit;
    for (;;) {
      const done = await page.evaluate((end) => window.seen.some(
        (a) => a.type === 'message' && a.role === 'bot' && a.text.endsWith(end)), END);
      if (done) break;
      const failed = posts.some((p) => p.status >= 400);
      if (Date.now() > deadline || (failed && performance.now() - sentAtHere > TURN_MS + 5000)) {
        settled = false;
        break;
      }
      await sleep(200);
    }
    await sleep(1500);
    await page.screenshot({ path: path.join(opts.artifacts, 'gateway-streaming-webchat-60s.png') });
    const state = await page.evaluate(() => ({
      seen: window.seen,
      shown: window.shown,
      failed: Array.from(document.querySelectorAll('.webchat__activity-status--send-failed, [class*="send-failed"]')).length,
      statusTexts: Array.from(document.querySelectorAll('.webchat__activity-status')).map((e) => e.innerText.trim()),
      bubbles: Array.from(document.querySelectorAll('.webchat__bubble:not(.webchat__bubble--from-user) .webchat__bubble__content')).map((b) => b.innerText.trim()),
    }));
    const interim = state.seen.filter((a) => a.type === 'typing' && a.role === 'bot' && (a.streamType === 'streaming' || a.streamType === 'informative'));
    const finals = state.seen.filter((a) => a.type === 'message' && a.role === 'bot');
    const draftsShown = state.shown.filter((s) => s.bubbles.some((b) => b.length > 0 && !b.endsWith(END))).length;
    result = {
      name: 'long-webchat',
      turnMs: TURN_MS,
      webChatTimeoutMs: webChatTimeout,
      settled,
      interimActivities: interim.length,
      firstInterimMs: interim.length ? interim[0].at - sentAt : null,
      lastInterimMs: interim.length ? interim[interim.length - 1].at - sentAt : null,
      draftBubbleStates: draftsShown,
      finals: finals.length,
      finalMs: finals.length ? finals[0].at - sentAt : null,
      finalStreamType: finals.length ? finals[0].streamType : null,
      postStatuses: posts.map((p) => p.status),
      sendFailedMarks: state.failed,
      activityStatus: state.statusTexts,
      bubbles: state.bubbles,
      errors,
    };
  } finally {
    await browser.close();
    site.close();
  }
  log(`== Web Chat, one ${TURN_MS / 1000} s turn: settled ${result.settled}, ${result.interimActivities} interim activities `
    + `(first at ${fmt(result.firstInterimMs)} ms, last at ${fmt(result.lastInterimMs)} ms), ${result.draftBubbleStates} draft states shown, `
    + `${result.finals} final(s) at ${fmt(result.finalMs)} ms, POST statuses ${JSON.stringify(result.postStatuses)}, `
    + `activity status ${JSON.stringify(result.activityStatus)}, errors ${result.errors.length}`);
  return result;
}

const fmt = (v) => (v === null || v === undefined ? '-' : Math.round(v));

// --- runs counted by the worker -----------------------------------------------------------------

function runsOf(file) {
  if (!fs.existsSync(file)) return [];
  return fs.readFileSync(file, 'utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
}

function countRuns(file, ids) {
  const lines = runsOf(file);
  return ids.map((id) => ({
    runs: lines.filter((l) => l.id === id && l.event === 'run').length,
    sent: lines.filter((l) => l.id === id && l.event === 'sent').length,
  }));
}

// --- commands -------------------------------------------------------------------------------------

async function firstDraftTeams() {
  const cn = await connector();
  const turns = num('turns', 96);
  const concurrency = num('concurrency', 32);
  const limit = TURN_MS * 3 + 30000;
  const results = await pool(turns, concurrency, (i) =>
    teamsTurn(cn, opts.gateway, `a:bench-${RUN}-${i}`, `act-${RUN}-${i}`, limit));
  await sleep(1000);
  // Anything that came after the final (a second final would show here).
  for (const r of results) r.finals = cn.events(r.conversation).filter(isFinal).length;
  await cn.close();
  return report(opts.name || 'teams', results, { concurrency, turnMs: TURN_MS, connectorRefused: cn.refused() });
}

async function firstDraftDirectLine() {
  const turns = num('turns', 96);
  const concurrency = num('concurrency', 32);
  const limit = TURN_MS * 3 + 30000;
  const results = await pool(turns, concurrency, () => directLineTurn(opts.gateway, opts.secret, limit));
  const out = report(opts.name || 'directline', results, { concurrency, turnMs: TURN_MS });
  out.postStatusBodies = countBy(results.filter((r) => r.statusBody).map((r) => r.statusBody));
  out.lastDraftMs = summary(results.map((r) => r.lastDraftMs));
  log(`   last draft ms   ${JSON.stringify(out.lastDraftMs)}`);
  if (Object.keys(out.postStatusBodies).length) log(`   error bodies    ${JSON.stringify(out.postStatusBodies)}`);
  return out;
}

async function longTeams() {
  const cn = await connector();
  const r = await teamsTurn(cn, opts.gateway, `a:bench-long-${RUN}`, `act-long-${RUN}`, TURN_MS * 2 + 30000);
  await sleep(2000);
  const events = cn.events(r.conversation);
  r.finals = events.filter(isFinal).length;
  await cn.close();
  const gaps = [];
  const drafts = events.filter(isDraft);
  for (let i = 1; i < drafts.length; i++) gaps.push(drafts[i].at - drafts[i - 1].at);
  const out = {
    name: 'long-teams',
    turnMs: TURN_MS,
    ...r,
    draftGapMs: summary(gaps),
    sequencesInOrder: r.sequences.every((s, i) => s === i + 1),
    streamIdsConsistent: new Set(drafts.slice(1).map((d) => d.streamId)).size <= 1,
    connectorRefused: cn.refused(),
  };
  delete out.sequences;
  log(`== Teams, one ${TURN_MS / 1000} s turn: POST ${out.status} in ${fmt(out.answeredMs)} ms; ${out.drafts} drafts `
    + `(${out.informative} informative; first at ${fmt(out.firstDraftMs)} ms; gaps ${JSON.stringify(out.draftGapMs)}), `
    + `sequences 1..n ${out.sequencesInOrder}; ${out.finals} final(s) (${out.finalStreamType}) at ${fmt(out.finalMs)} ms`);
  return out;
}

/// Turns on replica A's gateway, A SIGKILLed halfway, then the same activities to replica B.
async function kill() {
  const cn = await connector();
  const turns = num('turns', 8);
  const limit = TURN_MS * 3 + 30000;
  const killAt = num('kill-at-ms', TURN_MS / 2);
  const ids = Array.from({ length: turns }, (_, i) => `kill-${RUN}-${i}`);
  const convs = ids.map((id) => `a:${id}`);
  const activities = ids.map((id, i) => teamsActivity(cn.url, convs[i], id, 'count'));
  const start = now();
  const first = await Promise.all(activities.map((a) => postMessages(opts.gateway, a)));
  await sleep(Math.max(0, killAt - (now() - start)));
  const beforeKill = convs.map((c) => cn.events(c).filter(isDraft).length);
  process.kill(Number(opts['kill-pid']), 'SIGKILL');
  const killedAt = now() - start;
  log(`   SIGKILLed replica A (pid ${opts['kill-pid']}) at ${Math.round(killedAt)} ms; drafts seen by then per turn ${JSON.stringify(beforeKill)}`);
  await sleep(num('retry-after-ms', 1000));
  const retryStart = now();
  const retried = await Promise.all(activities.map((a) => postMessages(opts['gateway-b'], a)));
  const finals = await Promise.all(convs.map((c) => cn.when(c, isFinal, limit)));
  await sleep(3000);
  await cn.close();
  const runs = countRuns(opts['runs-file'], ids);
  const results = ids.map((id, i) => {
    const events = cn.events(convs[i]);
    return {
      id,
      firstStatus: first[i].status,
      retryStatus: retried[i].status,
      draftsBeforeKill: beforeKill[i],
      draftsAfterRetry: events.filter((e) => isDraft(e) && e.at >= retryStart).length,
      // Each stream's first draft has sequence 1; the final ends one of them.
      streamsOpened: events.filter((e) => isDraft(e) && e.streamSequence === 1).length,
      finals: events.filter(isFinal).length,
      finalStreamTypes: events.filter(isFinal).map((f) => f.streamType),
      finalAfterRetryMs: finals[i] ? finals[i].at - retryStart : null,
      runs: runs[i].runs,
      runsThatSent: runs[i].sent,
    };
  });
  const out = {
    name: 'kill',
    turns,
    turnMs: TURN_MS,
    killedAtMs: killedAt,
    ids,
    finalsPerActivity: countBy(results.map((r) => r.finals)),
    runsPerActivity: countBy(results.map((r) => r.runs)),
    streamsPerActivity: countBy(results.map((r) => r.streamsOpened)),
    finalAfterRetryMs: summary(results.map((r) => r.finalAfterRetryMs)),
    statuses: { first: countBy(first.map((r) => r.status)), retry: countBy(retried.map((r) => r.status)) },
    results,
  };
  log(`== replica A killed mid-stream, retried on B: ${turns} activities; finals per activity ${JSON.stringify(out.finalsPerActivity)}, `
    + `bot runs per activity ${JSON.stringify(out.runsPerActivity)}, streams opened per activity ${JSON.stringify(out.streamsPerActivity)}, final after the retry ms ${JSON.stringify(out.finalAfterRetryMs)}, `
    + `statuses ${JSON.stringify(out.statuses)}`);
  return out;
}

/// Turns on replica A's gateway, each activity sent again `at-ms` in to A (same) or B (other).
async function redeliver() {
  const cn = await connector();
  const turns = num('turns', 8);
  const at = num('at-ms', 15000);
  const limit = TURN_MS * 3 + 30000;
  const to = opts.to === 'other' ? opts['gateway-b'] : opts.gateway;
  const ids = Array.from({ length: turns }, (_, i) => `redeliver-${opts.to}-${RUN}-${i}`);
  const convs = ids.map((id) => `a:${id}`);
  const activities = ids.map((id, i) => teamsActivity(cn.url, convs[i], id, 'count'));
  const start = now();
  const first = await Promise.all(activities.map((a) => postMessages(opts.gateway, a)));
  await sleep(Math.max(0, at - (now() - start)));
  const again = await Promise.all(activities.map((a) => postMessages(to, a)));
  // Both turns end: the first at ~TURN_MS, a second run (if any) TURN_MS after the redelivery.
  await Promise.all(convs.map((c) => cn.when(c, isFinal, limit)));
  const quiet = num('quiet-ms', TURN_MS + 5000);
  await sleep(Math.max(0, at + TURN_MS + 5000 - (now() - start)));
  await sleep(Math.min(quiet, 5000));
  await cn.close();
  const runs = countRuns(opts['runs-file'], ids);
  const results = ids.map((id, i) => {
    const events = cn.events(convs[i]);
    const finals = events.filter(isFinal);
    return {
      id,
      firstStatus: first[i].status,
      againStatus: again[i].status,
      drafts: events.filter(isDraft).length,
      streamsOpened: events.filter((e) => isDraft(e) && e.streamSequence === 1).length,
      finals: finals.length,
      finalsMs: finals.map((f) => Math.round(f.at - start)),
      // `final` ends a stream; null is a plain message.
      finalStreamTypes: finals.map((f) => f.streamType),
      distinctFinalTexts: new Set(finals.map((f) => f.text)).size,
      runs: runs[i].runs,
      runsThatSent: runs[i].sent,
    };
  });
  const out = {
    name: `redeliver-${opts.to}`,
    turns,
    turnMs: TURN_MS,
    atMs: at,
    ids,
    runsPerActivity: countBy(results.map((r) => r.runs)),
    meanRuns: results.reduce((s, r) => s + r.runs, 0) / turns,
    finalsPerActivity: countBy(results.map((r) => r.finals)),
    streamsPerActivity: countBy(results.map((r) => r.streamsOpened)),
    statuses: { first: countBy(first.map((r) => r.status)), again: countBy(again.map((r) => r.status)) },
    results,
  };
  log(`== redelivery ${at / 1000} s into a ${TURN_MS / 1000} s turn, to the ${opts.to} replica: ${turns} activities; `
    + `bot runs per activity ${JSON.stringify(out.runsPerActivity)} (mean ${out.meanRuns}), finals per activity ${JSON.stringify(out.finalsPerActivity)}, `
    + `streams opened per activity ${JSON.stringify(out.streamsPerActivity)}, statuses ${JSON.stringify(out.statuses)}`);
  return out;
}

const commands = {
  'first-draft-teams': firstDraftTeams,
  'first-draft-directline': firstDraftDirectLine,
  'long-teams': longTeams,
  'long-webchat': longWebChat,
  kill,
  redeliver,
};

(async () => {
  const run = commands[command];
  if (!run) throw new Error('unknown command ' + command + '; one of ' + Object.keys(commands).join(', '));
  const out = await run();
  console.log(JSON.stringify(out));
})().catch((e) => {
  console.error(e && e.stack || String(e));
  process.exit(1);
});
