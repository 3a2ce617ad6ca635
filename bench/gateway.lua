-- wrk script for bench/gateway.py: POSTs one chat-completion body, or a new one per request, and counts
-- each answer's status and the gateway's `x-tiergate-cache` header (hit, miss, bypass; none elsewhere); an answer
-- that is not 2xx is counted by its status and its OpenAI error `code` (what refused it).
--
--   wrk -t1 -c16 -d10s -s bench/gateway.lua http://127.0.0.1:PORT/v1/chat/completions -- KEY BODY UNIQUE NONCE
--
-- KEY: the bearer key ("-" for none). BODY: the request's JSON; with UNIQUE=1 its "@UNIQUE@" is replaced per
-- request by text no other request of the run (NONCE), thread or connection sends: the run's nonce, the
-- thread, a counter and six random words, so neither the exact nor the semantic cache can answer it.
-- done() prints one line, "BENCH_RESULT {json}", that the harness reads: wrk's own counts, errors and
-- latency percentiles (microseconds, from wrk's histogram after its coordinated-omission correction).

local threads = {}

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

local WORDS = {
  "amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp",
  "lantern", "meadow", "nectar", "obsidian", "pepper", "quartz", "raven", "saffron", "tundra", "umber",
  "velvet", "walnut", "xenon", "yarrow", "zephyr", "anchor", "bramble", "cobalt", "dune", "estuary",
  "falcon", "glacier", "hazel", "iris", "jasper", "kestrel", "lichen", "marble", "nettle", "orchid",
  "pylon", "quiver", "reef", "sorrel", "thistle", "urchin", "vortex", "willow", "yucca", "zinnia",
  "compiler", "tariff", "sonnet", "enzyme", "ledger", "piston", "opera", "satellite", "mortgage",
  "volcano", "algebra", "pastry", "voltage",
}

local unique, template, nonce, counter, fixed = false, "", "0", 0, nil
hit, miss, bypass, nocache, ok, notok = 0, 0, 0, 0, 0, 0
refusals = {}  -- "STATUS CODE" -> count, for answers that are not 2xx

function init(args)
  local key = args[1] or "-"
  template = args[2] or "{}"
  unique = args[3] == "1"
  nonce = args[4] or "0"
  wrk.method = "POST"
  wrk.headers["Content-Type"] = "application/json"
  if key ~= "-" then
    wrk.headers["Authorization"] = "Bearer " .. key
  end
  math.randomseed((tonumber(nonce) or 0) % 2147483647 + (tid or 0) * 7919)
  fixed = wrk.format(nil, nil, nil, template)
end

function request()
  if not unique then
    return fixed
  end
  counter = counter + 1
  local words = {}
  for i = 1, 6 do
    words[i] = WORDS[math.random(#WORDS)]
  end
  local text = "ask " .. nonce .. "-" .. (tid or 0) .. "-" .. counter .. ": " .. table.concat(words, " ")
  local body = string.gsub(template, "@UNIQUE@", text, 1)
  return wrk.format(nil, nil, nil, body)
end

function response(status, headers, body)
  if status >= 200 and status < 300 then
    ok = ok + 1
  else
    notok = notok + 1
    local code = string.match(body or "", '"code"%s*:%s*"([%w_%.%-]+)"') or "?"
    local what = status .. " " .. code
    refusals[what] = (refusals[what] or 0) + 1
  end
  local cache = headers["x-tiergate-cache"]
  if cache == "hit" then
    hit = hit + 1
  elseif cache == "miss" then
    miss = miss + 1
  elseif cache == "bypass" then
    bypass = bypass + 1
  else
    nocache = nocache + 1
  end
end

local function sum(name)
  local total = 0
  for _, thread in ipairs(threads) do
    total = total + (thread:get(name) or 0)
  end
  return total
end

local function refusal_counts()
  local total = {}
  for _, thread in ipairs(threads) do
    for what, n in pairs(thread:get("refusals") or {}) do
      total[what] = (total[what] or 0) + n
    end
  end
  local parts = {}
  for what, n in pairs(total) do
    table.insert(parts, string.format('"%s":%d', what, n))
  end
  return "{" .. table.concat(parts, ",") .. "}"
end

function done(summary, latency, requests)
  local e = summary.errors
  local parts = {
    string.format('"requests":%d,"duration_us":%d,"bytes":%d', summary.requests, summary.duration, summary.bytes),
    string.format('"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}',
                  e.connect, e.read, e.write, e.status, e.timeout),
    string.format('"answers":{"2xx":%d,"other":%d,"hit":%d,"miss":%d,"bypass":%d,"none":%d}',
                  sum("ok"), sum("notok"), sum("hit"), sum("miss"), sum("bypass"), sum("nocache")),
    '"refusals":' .. refusal_counts(),
    string.format('"latency_us":{"min":%d,"mean":%.1f,"max":%d,"p50":%d,"p90":%d,"p99":%d,"p99.9":%d}',
                  latency.min, latency.mean, latency.max, latency:percentile(50), latency:percentile(90),
                  latency:percentile(99), latency:percentile(99.9)),
  }
  io.write("BENCH_RESULT {" .. table.concat(parts, ",") .. "}\n")
end
