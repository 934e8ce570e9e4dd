// The coordinator's live page (served at / by server/_page.py): asks the coordinator for its jobs
// every second and draws them: members, what each rank waits in, the ranks holding a job back,
// recent events, store size. Read-only: it only ever GETs "jobs" and "auth".
//
// Access (server/_page_access.py): with a token, the page takes it from the URL fragment
// (#token=SECRET, never sent by a browser), removes it from the address bar, and proves it holds
// it: GET auth gives a nonce, the page answers with HMAC-SHA256(token, label + nonce) computed by
// hmac.js, and gets a short-lived session value it sends as "Authorization: Bearer". The token
// stays in this tab's memory only, to prove again when a session ends; the session value is kept
// in sessionStorage (this tab, this origin), so a reload goes on without the token.
//
// Everything shown is set as text (textContent, never HTML), whatever a job or host is called.
"use strict";

(function () {
  const POLL_MS = 1000;
  const SESSION_KEY = "aiocoll.session";
  const PROOF_LABEL = "aiocoll page|";
  const BAD_EVENTS = new Set(["lost", "join_refused", "join_timeout", "connection_refused", "mismatch", "behind"]);
  const GOOD_EVENTS = new Set(["join", "round_complete", "resumed"]);

  let token = null; // from the fragment; memory only
  let refused = false; // the coordinator refused this token's proof: do not try it again
  let session = readSession();
  let lastAnswer = null; // Date of the last answer with jobs

  const $ = (id) => document.getElementById(id);

  function readSession() {
    try {
      return window.sessionStorage.getItem(SESSION_KEY);
    } catch (err) {
      return null; // storage disabled: the token in memory will do
    }
  }

  function keepSession(value) {
    session = value;
    try {
      if (value) {
        window.sessionStorage.setItem(SESSION_KEY, value);
      } else {
        window.sessionStorage.removeItem(SESSION_KEY);
      }
    } catch (err) {
      // storage disabled: the session lives as long as this page
    }
  }

  // #token=SECRET (percent-encoded or not): take it, and take it out of the address bar and the
  // history, so it is not left on screen, in a screenshot or in the browser's history.
  function takeToken() {
    const hash = window.location.hash;
    if (!hash.startsWith("#token=")) {
      return;
    }
    let value = hash.slice("#token=".length);
    try {
      value = decodeURIComponent(value);
    } catch (err) {
      // not percent-encoded after all: take it as it is
    }
    token = value;
    refused = false;
    keepSession(null);
    window.history.replaceState(null, "", window.location.pathname + window.location.search);
  }

  async function getJson(url, headers) {
    const response = await fetch(url, {
      cache: "no-store",
      credentials: "omit",
      referrerPolicy: "no-referrer",
      headers: headers || {},
    });
    let body = null;
    try {
      body = await response.json();
    } catch (err) {
      body = null;
    }
    return { status: response.status, body: body };
  }

  // Challenge-response: true when a session was granted (or the coordinator has no token).
  async function prove() {
    const challenge = await getJson("auth");
    if (challenge.status !== 200 || !challenge.body) {
      throw new Error("auth answered " + challenge.status);
    }
    if (!challenge.body.token) {
      return true;
    }
    const crypto = window.aiocollHmac;
    const nonce = String(challenge.body.nonce);
    const proof = crypto.hex(crypto.hmacSha256(crypto.utf8(token), crypto.utf8(PROOF_LABEL + nonce)));
    const answer = await getJson("auth?nonce=" + encodeURIComponent(nonce) + "&proof=" + proof);
    if (answer.status === 200 && answer.body && answer.body.session) {
      keepSession(String(answer.body.session));
      return true;
    }
    if (answer.status === 403) {
      refused = true;
      token = null;
    }
    return false;
  }

  async function fetchJobs() {
    const headers = session ? { Authorization: "Bearer " + session } : {};
    let reply = await getJson("jobs", headers);
    if (reply.status === 401) {
      keepSession(null);
      if (token !== null && !refused && (await prove())) {
        reply = await getJson("jobs", session ? { Authorization: "Bearer " + session } : {});
      }
    }
    return reply;
  }

  async function refresh() {
    try {
      const reply = await fetchJobs();
      if (reply.status === 200 && reply.body && Array.isArray(reply.body.jobs)) {
        lastAnswer = new Date();
        showNotice(reply.body.token ? null : "open");
        render(reply.body);
        setLive("live", "live \u00b7 updated " + clock(lastAnswer));
      } else if (reply.status === 401) {
        $("jobs").replaceChildren();
        showNotice(refused ? "refused" : "locked");
        setLive("locked", "nothing shown: this coordinator has a token");
      } else {
        setLive("stale", "the coordinator answered " + reply.status + staleSince());
      }
    } catch (err) {
      setLive("stale", "the coordinator does not answer" + staleSince());
    }
    window.setTimeout(refresh, POLL_MS);
  }

  function staleSince() {
    return lastAnswer ? "; what is shown is from " + clock(lastAnswer) : "";
  }

  function setLive(state, text) {
    const live = $("live");
    live.dataset.state = state;
    live.textContent = text;
    $("jobs").classList.toggle("stale", state === "stale");
  }

  function showNotice(kind) {
    const notice = $("notice");
    const where = window.location.origin + window.location.pathname;
    const text = {
      open:
        "This coordinator has no token: anyone who can reach its HTTP port sees these jobs, " +
        "and anyone who can reach its main port can join them. Give it a token (--token-file or AIOCOLL_TOKEN).",
      locked:
        "This coordinator has a token, and this page shows nothing of its jobs until you give it. " +
        "Open the page as " + where + "#token=YOUR_TOKEN: the page proves it holds the token " +
        "and never sends it.",
      refused:
        "The coordinator refused the token in the link (it is not this coordinator's token). " +
        "Open the page as " + where + "#token=YOUR_TOKEN with the right one.",
    }[kind];
    notice.hidden = !text;
    notice.dataset.kind = kind || "";
    notice.textContent = text || "";
  }

  // -- drawing ----------------------------------------------------------------------------------

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value !== null && value !== undefined) {
        node.setAttribute(name, String(value));
      }
    }
    for (const child of [].concat(children === undefined ? [] : children)) {
      node.append(child instanceof Node ? child : String(child)); // a string becomes a text node
    }
    return node;
  }

  function clock(date) {
    return date.toLocaleTimeString([], { hour12: false });
  }

  function age(seconds) {
    if (typeof seconds !== "number" || !isFinite(seconds)) {
      return "\u2013";
    }
    seconds = Math.max(0, seconds);
    if (seconds < 60) {
      return seconds.toFixed(1) + " s";
    }
    if (seconds < 3600) {
      return (seconds / 60).toFixed(1) + " min";
    }
    return (seconds / 3600).toFixed(1) + " h";
  }

  function memberState(member) {
    const state = member.state || (member.alive ? "alive" : "lost");
    if (state === "alive" && (member.progress || []).some((entry) => entry.state === "slow")) {
      return "slow";
    }
    return state;
  }

  function render(data) {
    const jobs = data.jobs;
    const now = typeof data.time === "number" ? data.time : Date.now() / 1000;
    const sections = jobs.map((job) => renderJob(job, now));
    if (!sections.length) {
      sections.push(el("p", { class: "empty" }, "This coordinator holds no job."));
    }
    $("jobs").replaceChildren(...sections);
  }

  function renderJob(job, now) {
    const held = new Set(job.held_back_by || []);
    const members = job.members || [];
    const total = typeof job.members_total === "number" ? job.members_total : members.length;
    const alive = typeof job.members_alive === "number" ? job.members_alive : members.filter((m) => m.alive).length;
    const facts = [
      job.round === null || job.round === undefined ? "no rendezvous yet" : "round " + job.round,
      job.world_size ? "world size " + job.world_size : null,
      job.round === null || job.round === undefined ? null : job.complete ? "complete" : "forming",
      alive + " of " + total + " alive",
      job.keys + (job.keys === 1 ? " key" : " keys") + " in the store",
      job.connections + (job.connections === 1 ? " connection" : " connections"),
    ].filter((fact) => fact !== null);
    const section = el("section", { class: "job", "data-job": job.job, "data-held": held.size ? "true" : "false" }, [
      el("h2", {}, [el("span", { class: "name" }, job.job), " ", el("span", { class: "facts" }, facts.join(" \u00b7 "))]),
    ]);
    if (job.summary) {
      section.append(el("p", { class: held.size ? "summary held" : "summary" }, job.summary));
    }
    if (members.length) {
      section.append(renderMembers(members, held));
      if (total > members.length) {
        section.append(
          el("p", { class: "more" }, total - members.length + " more members not shown: listed are those not alive, " +
            "holding the job back or reporting progress, then the lowest ranks"),
        );
      }
    } else {
      section.append(el("p", { class: "empty" }, "No members: no rank has joined a rendezvous of this job."));
    }
    section.append(renderEvents(job.events || [], now));
    return section;
  }

  function renderMembers(members, held) {
    const head = el("tr", {}, ["Rank", "Host", "State", "Last heard", "Waits in", "Op state", "For", "Waiting for"].map(
      (name) => el("th", { scope: "col" }, name),
    ));
    const rows = members.map((member) => {
      const state = memberState(member);
      const holds = held.has(member.rank);
      const progress = member.progress || [];
      const rankCell = el("td", { class: "rank" }, String(member.rank));
      if (holds) {
        rankCell.append(" ", el("span", { class: "tag held" }, "holds the job back"));
      }
      const stateCell = el("td", { class: "state" }, el("span", { class: "dot state-" + state }, state));
      if (member.reason && state !== "alive" && member.reason !== state) { // no "left left"
        stateCell.append(el("div", { class: "reason" }, member.reason));
      }
      const lines = (pick) => progress.map((entry) => el("div", {}, pick(entry)));
      const waitsIn = progress.length
        ? lines((e) => (e.group === null ? "" : "group " + (e.group_name || e.group) + " seq " + e.seq + ": ") + e.op)
        : member.alive ? "running (nothing waits past the threshold)" : "\u2013";
      const waitingFor = progress.map((entry) => {
        const ranks = entry.waiting_for || [];
        const line = el("div");
        ranks.forEach((rank, i) => {
          line.append(i ? ", " : "", held.has(rank) ? el("strong", { class: "held" }, String(rank)) : String(rank));
        });
        if (!ranks.length) {
          line.append("\u2013");
        }
        return line;
      });
      const opCell = el("td", { class: "op" }, waitsIn);
      if (holds && member.stack) { // where in the user's code the rank holding the job back is now
        opCell.append(renderStack(member));
      }
      return el("tr", { "data-rank": member.rank, "data-state": state, "data-held": holds ? "true" : "false",
        class: holds ? "held" : null }, [
        rankCell,
        el("td", { class: "host", title: member.host || "" }, member.hostname || member.host || "\u2013"),
        stateCell,
        el("td", { class: "num" }, age(member.last_seen) + " ago"),
        opCell,
        el("td", {}, progress.length ? lines((e) => e.state) : "\u2013"),
        el("td", { class: "num" }, progress.length ? lines((e) => age(e.age)) : "\u2013"),
        el("td", {}, progress.length ? waitingFor : "\u2013"),
      ]);
    });
    return el("table", { class: "members" }, [el("thead", {}, head), el("tbody", {}, rows)]);
  }

  function renderStack(member) {
    const frames = member.stack || [];
    const when = member.stack_age >= 0.5 ? " (" + age(member.stack_age) + " ago)" : "";
    const box = el("details", { class: "stack", open: "" },
      el("summary", {}, "its Python stack now" + when + ", the user's frames first"));
    const list = el("ol", {});
    frames.slice(0, 12).forEach((f) => {
      list.append(el("li", {}, [el("code", {}, f.file + ":" + f.line), " in " + f.function]));
    });
    if (!frames.length) {
      list.append(el("li", {}, "no frames"));
    }
    box.append(list);
    return box;
  }

  function renderEvents(events, now) {
    const box = el("div", { class: "events" }, el("h3", {}, "Recent events"));
    if (!events.length) {
      box.append(el("p", { class: "empty" }, "None since the coordinator started."));
      return box;
    }
    const items = events.slice().reverse().map((event) => {
      const tone = BAD_EVENTS.has(event.kind) ? "bad" : GOOD_EVENTS.has(event.kind) ? "good" : "plain";
      const when = new Date(event.time * 1000);
      return el("li", { "data-kind": event.kind, class: tone }, [
        el("time", { datetime: when.toISOString(), title: when.toString() }, clock(when)),
        el("span", { class: "ago" }, age(now - event.time) + " ago"),
        el("span", { class: "text" }, event.text),
      ]);
    });
    box.append(el("ol", {}, items));
    return box;
  }

  window.addEventListener("hashchange", () => {
    takeToken();
  });
  $("where").textContent = window.location.host;
  takeToken();
  refresh();
})();
