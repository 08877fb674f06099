// Turnstile's chat page: a Direct Line 3.0 client in plain JavaScript. It starts a conversation,
// posts what the user types, and shows the transcript as the gateway streams it (WebSocket) or,
// when no stream can be had, as it polls it. A Direct Line token can be given as #token=… (a
// gateway with a Direct Line secret needs one; in development none is needed).
//
// A bot that writes its answer over seconds is shown as it writes: the gateway streams its
// drafts as a livestream (interim `typing` activities whose channelData says streamType,
// streamSequence and, after the first, streamId), and the committed message that ends it
// (streamType `final`) takes the draft's place. Drafts are never in the transcript. While a
// draft is being written a Stop button sits under it: it asks the gateway to stop the turn at
// the text on screen, which is then the committed reply that settles the draft.
'use strict';

(() => {
  const API = '/v3/directline';
  const POLL_MS = 1000;
  const transcript = document.getElementById('transcript');
  const suggestions = document.getElementById('suggestions');
  const form = document.getElementById('composer');
  const input = document.getElementById('message');
  const sendButton = document.getElementById('send');
  const status = document.getElementById('status');

  let conversationId = '';
  let token = new URLSearchParams(location.hash.slice(1)).get('token') || '';
  let watermark = '';
  let polling = null;
  let reading = false;
  let next = 0;
  const shown = new Set();
  const pending = new Map();
  // Livestreams by stream id (the first interim activity's id): the draft's list item, the
  // latest sequence shown, the text on screen, and whether the final message has settled it.
  const livestreams = new Map();

  function headers(json) {
    const h = { Accept: 'application/json' };
    if (json) h['Content-Type'] = 'application/json';
    if (token) h.Authorization = 'Bearer ' + token;
    return h;
  }

  async function call(method, path, body) {
    const response = await fetch(API + path, {
      method,
      headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    const data = text ? JSON.parse(text) : {};
    if (!response.ok) {
      const message = (data.error && data.error.message) || response.statusText;
      throw new Error(response.status + ' ' + message);
    }
    return data;
  }

  // `code` spans, as the bots write them; everything else is plain text (never HTML).
  function textInto(element, text) {
    text.split('`').forEach((part, i) => {
      if (i % 2 === 1) {
        const code = document.createElement('code');
        code.textContent = part;
        element.appendChild(code);
      } else if (part) {
        element.appendChild(document.createTextNode(part));
      }
    });
  }

  function actionButtons(actions) {
    const box = document.createElement('div');
    box.className = 'actions';
    for (const action of actions || []) {
      const button = document.createElement('button');
      button.type = 'button';
      button.textContent = action.title || action.value || '';
      if (action.type === 'openUrl') {
        button.addEventListener('click', () => window.open(action.value, '_blank', 'noopener'));
      } else {
        const value = typeof action.value === 'string' ? action.value : action.title;
        button.addEventListener('click', () => send(value));
      }
      box.appendChild(button);
    }
    return box;
  }

  function card(attachment) {
    const content = attachment.content || {};
    const box = document.createElement('section');
    box.className = 'card';
    if (attachment.contentType === 'application/vnd.microsoft.card.hero' ||
        attachment.contentType === 'application/vnd.microsoft.card.thumbnail') {
      for (const image of content.images || []) {
        if (typeof image.url === 'string' && /^(https?:|data:image\/)/.test(image.url)) {
          const img = document.createElement('img');
          img.src = image.url;
          img.alt = image.alt || content.title || '';
          box.appendChild(img);
        }
      }
      if (content.title) {
        const h = document.createElement('h2');
        h.textContent = content.title;
        box.appendChild(h);
      }
      if (content.subtitle) {
        const p = document.createElement('p');
        p.className = 'subtitle';
        p.textContent = content.subtitle;
        box.appendChild(p);
      }
      if (content.text) {
        const p = document.createElement('p');
        textInto(p, content.text);
        box.appendChild(p);
      }
      if (content.buttons && content.buttons.length) box.appendChild(actionButtons(content.buttons));
    } else {
      const p = document.createElement('p');
      p.textContent = '[' + (attachment.name || attachment.contentType || 'attachment') + ']';
      box.appendChild(p);
    }
    return box;
  }

  // Fills `item` with the message's text and cards.
  function render(item, activity) {
    item.replaceChildren();
    if (activity.text) {
      const bubble = document.createElement('div');
      bubble.className = 'bubble';
      textInto(bubble, activity.text);
      item.appendChild(bubble);
    }
    for (const attachment of activity.attachments || []) item.appendChild(card(attachment));
  }

  function streamInfo(activity) {
    const data = activity.channelData || {};
    return typeof data.streamType === 'string' ? data : null;
  }

  // An interim activity: the draft so far (or a status line) replaces what its livestream
  // showed; an older or late one is ignored.
  function showInterim(activity, info) {
    const streamId = info.streamId || activity.id;
    let live = livestreams.get(streamId);
    if (!live) {
      const item = document.createElement('li');
      item.className = 'activity draft';
      item.dataset.role = 'bot';
      item.dataset.stream = streamId;
      const bubble = document.createElement('div');
      const stopButton = document.createElement('button');
      stopButton.type = 'button';
      stopButton.className = 'stop';
      stopButton.textContent = 'Stop';
      item.append(bubble, stopButton);
      transcript.appendChild(item);
      live = { item, bubble, sequence: 0, text: '', settled: false };
      livestreams.set(streamId, live);
      const stopped = live;
      stopButton.addEventListener('click', () => stop(activity.replyToId, stopped, stopButton));
    }
    const sequence = Number(info.streamSequence) || 0;
    // Stopping: the screen keeps what the user saw, unless the gateway erases it.
    if (live.settled || (live.stopping && activity.text) || sequence <= live.sequence) return;
    live.sequence = sequence;
    const bubble = document.createElement('div');
    bubble.className = 'bubble';
    if (info.streamType === 'informative') {
      bubble.classList.add('informative');
      bubble.textContent = activity.text || '…';
    } else if (activity.text) {
      textInto(bubble, activity.text);
      live.text = activity.text;
    } else {
      bubble.classList.add('informative');
      bubble.textContent = '…';
      live.text = '';
    }
    live.bubble.replaceWith(bubble);
    live.bubble = bubble;
    transcript.scrollTop = transcript.scrollHeight;
  }

  // Stop: the turn of `activityId` commits the text on screen, which stays as it is meanwhile;
  // the committed message then settles the draft.
  async function stop(activityId, live, button) {
    if (!activityId || live.settled) return;
    live.stopping = true;
    button.disabled = true;
    try {
      const path = '/conversations/' + encodeURIComponent(conversationId) + '/activities/'
        + encodeURIComponent(activityId) + '/stop';
      await call('POST', path, { shownText: live.text });
    } catch (e) {
      // Too late or gone: the committed reply settles the draft as usual.
      live.stopping = false;
    }
  }

  function show(activity) {
    const info = streamInfo(activity);
    if (activity.type === 'typing' && info && info.streamType !== 'final') {
      showInterim(activity, info);
      return;
    }
    if (activity.type !== 'message' || shown.has(activity.id)) return;
    shown.add(activity.id);
    const role = activity.from && activity.from.role === 'bot' ? 'bot' : 'user';
    const clientId = activity.channelData && activity.channelData.clientActivityID;
    const live = info && info.streamType === 'final' && livestreams.get(info.streamId);
    let item = clientId && pending.get(clientId);
    if (item) {
      pending.delete(clientId);
      item.classList.remove('pending');
    } else if (live) {
      // The committed message settles its draft, in the draft's place.
      live.settled = true;
      item = live.item;
      item.classList.remove('draft');
      render(item, activity);
    } else {
      item = document.createElement('li');
      item.className = 'activity';
      item.dataset.role = role;
      render(item, activity);
      transcript.appendChild(item);
    }
    item.dataset.id = activity.id;
    // Suggested actions belong to the latest bot message only.
    if (role === 'bot') {
      suggestions.replaceChildren();
      const actions = activity.suggestedActions && activity.suggestedActions.actions;
      if (actions && actions.length) {
        suggestions.replaceChildren(...actionButtons(actions).children);
      }
    }
    transcript.scrollTop = transcript.scrollHeight;
  }

  function showGroup(group) {
    for (const activity of group.activities || []) show(activity);
    if (group.watermark) watermark = group.watermark;
  }

  async function read() {
    if (reading) return;
    reading = true;
    try {
      showGroup(await call('GET', '/conversations/' + conversationId +
        '/activities?watermark=' + encodeURIComponent(watermark)));
    } catch (error) {
      status.textContent = 'Cannot read the conversation: ' + error.message;
    } finally {
      reading = false;
    }
  }

  function poll() {
    if (!polling) polling = setInterval(read, POLL_MS);
  }

  function stream(url) {
    let socket;
    try {
      const target = new URL(url, location.href);
      target.protocol = location.protocol === 'https:' ? 'wss:' : 'ws:';
      target.host = location.host;
      socket = new WebSocket(target);
    } catch (_) {
      poll();
      return;
    }
    socket.onopen = () => {
      clearInterval(polling);
      polling = null;
      status.dataset.transport = 'stream';
    };
    socket.onmessage = (event) => {
      if (event.data) showGroup(JSON.parse(event.data));
    };
    socket.onclose = () => {
      status.textContent = 'Connected (polling)';
      status.dataset.transport = 'polling';
      poll();
    };
  }

  async function send(text) {
    text = text.trim();
    if (!text) return;
    suggestions.replaceChildren();
    const clientActivityID = 'c' + Date.now().toString(36) + '-' + (next++);
    const item = document.createElement('li');
    item.className = 'activity pending';
    item.dataset.role = 'user';
    const bubble = document.createElement('div');
    bubble.className = 'bubble';
    textInto(bubble, text);
    item.appendChild(bubble);
    transcript.appendChild(item);
    transcript.scrollTop = transcript.scrollHeight;
    pending.set(clientActivityID, item);
    try {
      await call('POST', '/conversations/' + conversationId + '/activities', {
        type: 'message',
        from: { id: 'user', role: 'user' },
        locale: navigator.language,
        text,
        channelData: { clientActivityID },
      });
      // The gateway answers only after the turn committed: the replies are there to read.
      await read();
    } catch (error) {
      pending.delete(clientActivityID);
      item.classList.remove('pending');
      item.classList.add('failed');
      const note = document.createElement('span');
      note.className = 'note';
      note.textContent = 'Not sent: ' + error.message;
      item.appendChild(note);
    }
  }

  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const text = input.value;
    input.value = '';
    input.focus();
    send(text);
  });

  async function start() {
    try {
      const conversation = await call('POST', '/conversations', {});
      conversationId = conversation.conversationId;
      token = conversation.token || token;
      status.textContent = 'Connected';
      input.disabled = false;
      sendButton.disabled = false;
      input.focus();
      await read();
      if (conversation.streamUrl && 'WebSocket' in window) stream(conversation.streamUrl);
      else poll();
      // Tokens last 30 minutes: renew every 15.
      setInterval(async () => {
        try {
          token = (await call('POST', '/tokens/refresh')).token;
        } catch (_) { /* the next call says what is wrong */ }
      }, 15 * 60 * 1000);
    } catch (error) {
      status.textContent = 'Cannot start a conversation: ' + error.message;
    }
  }

  start();
})();
