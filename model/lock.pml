/*
 * lock.pml -- a Promela model of tract_async's rack-wide lock without atomics (issue #17).
 *
 * What is modelled, and which code each step mirrors, is named in the comments; the README of
 * this folder (model/README.md) lists what is abstracted away and why. In short:
 *
 *   Waiter(i)   one per node: GlobalLock.acquire / _wait_grant / release / check_token
 *               (sync/lock.py) over slots.post_request / poll_grant / release / check_token
 *               (sync/slots.py), plus a critical section that increments a shared counter line.
 *               The node-local tier (local.py) is abstracted: one contender per node.
 *   Manager(i)  one per node: LockManager.run / _follow / _elect / _take_over / _manage /
 *               _revoke_dead (sync/manager.py) over slots.manager_step / _still_manager /
 *               write_state / write_grant (sync/slots.py).
 *   Env         crashes (at any step: Promela `unless`), restarts with a new epoch
 *               (NodeTable.join), stalls longer than the liveness timeout (a false "dead"
 *               verdict of a live node), the NodeInfo.dead verdict itself (region/nodes.py),
 *               the first heartbeat after a pause, and early write-back of a dirty line.
 *
 * Memory: every variable below the "memory" banner is what a load_fresh (invalidate + load)
 * returns.  A writer's stores go to its private cache; a flush publishes the whole line; an early
 * write-back may publish the line, with the stores made so far, before the flush.  Lines are read
 * whole (the code invalidates a line once and then loads its words).
 *
 * Properties (the runner model/check.py names the runs):
 *   safety    the Mutex process: at most one holder whose grant was not revoked; asserts: a
 *             revoked holder's write never lands, every earlier holder's write is visible to the
 *             next (no lost update), tokens that pass check_token only grow, a fresh grant fails
 *             check_token only if it was revoked; and no invalid end state (deadlock freedom)
 *   progress  (-DPROGRESS, pan -a -f) every lock attempt ends, under weak fairness
 *
 * Environment assumptions (each can be dropped to show why it is needed):
 *   A1  no stall boundary inside an open check -> store window (-DRESIDUAL_WINDOW drops it)
 *   A2  a resumed node beats before its other threads run   } -DOPEN_STALLS drops both; the
 *   A3  a node does not pause inside an election            } current code then fails
 *
 * Switches (spin -D...):
 *   N, WAITERS, CYCLES, MAXCRASH, MAXRESTART, MAXSTALL, MAXTMO, MAXIMPATIENT   bounds (below)
 *   RESIDUAL_WINDOW, OPEN_STALLS       drop assumption A1, or A2 and A3
 *   FIX_HOLDER_LEASE    proposed: check_token also needs the node's own heartbeat fresh
 *   FIX_ELECTION_LAPSE  proposed: a ticket is taken with a fresh heartbeat, and a candidate that
 *                       paused since its doorway does not enter the critical section
 *   Mutations (each must make the checker fail):
 *   MUT_NO_TOKEN_CHECK  the holder writes without GlobalLock.check_token
 *   MUT_NO_RECHECK      the manager notices a release only when the request line is idle
 *                       ("until slot == I") instead of rel_seq >= holder_req ("while slot == L")
 *   MUT_NO_CS_FLUSH     the holder releases without flushing its critical-section write
 *   MUT_NO_REL_FLUSH    slots.release stores rel_seq without flush + fence
 *   MUT_NO_STATE_FLUSH  slots.write_state stores the LOCK_STATE line without flush + fence
 *   MUT_NO_TERM_CHECK   slots._still_manager does not re-read the MANAGER line
 *   MUT_HOLDER_FIRST    slots.write_state stores `holder` first (the order before issue #17)
 *   MUT_NO_REVOKE       LockManager._revoke_dead never revokes
 */

#ifndef N
#define N 3
#endif
#ifndef CYCLES
#define CYCLES 1          /* lock cycles of one node incarnation */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1        /* node crashes, whole run */
#endif
#ifndef MAXRESTART
#define MAXRESTART 1      /* new incarnations after a crash, whole run */
#endif
#ifndef MAXSTALL
#define MAXSTALL 1        /* stalls longer than the liveness timeout, whole run */
#endif
#ifndef MAXTMO
#define MAXTMO 1          /* LockTimeout withdrawals per waiter incarnation */
#endif
#ifndef WAITERS
#define WAITERS N         /* nodes 0..WAITERS-1 take the lock; every node is a manager candidate */
#endif
#ifndef MAXIMPATIENT
#define MAXIMPATIENT 1    /* campaigns of a candidate with a lower live one, whole run */
#endif

#define NONE 255
#define GO 0
#define FENCED 1
#define LOST 2
#define TOKEN(term, n) ((term) * 16 + (n))   /* slots: token = term << 32 | n */

/* ---------------------------------------------------------------- memory (layout.py) ----- */
byte req_seq[N];          /* LOCK_REQ[j].req_seq      writer: node j (slots.post_request) */
byte rel_seq[N];          /* LOCK_REQ[j].rel_seq      writer: node j (slots.release) */
byte gr_seq[N];           /* LOCK_GRANT[j].grant_seq  writer: manager (slots.write_grant) */
byte gr_tok[N];           /* LOCK_GRANT[j].token      writer: manager */
byte st_holder;           /* LOCK_STATE.holder (node + 1, 0 = none)   writer: manager */
byte st_hreq;             /* LOCK_STATE.holder_req */
byte st_tok;              /* LOCK_STATE.token */
byte st_rr;               /* LOCK_STATE.rr_cursor */
byte mg_node;             /* MANAGER.manager (node + 1, 0 = none)  writer: elected candidate */
byte mg_term;             /* MANAGER.term */
byte mg_epoch;            /* MANAGER.epoch */
byte ca_number[N];        /* MANAGER_CANDIDATE[j].number  writer: node j (bakery; `choosing` is
                             folded into the one-step doorway) */
byte counter;             /* the data the lock protects: one line handed from holder to holder */

/* ------------------------------------------------------- node table and environment ----- */
byte epoch[N] = 1;        /* NODE[j].epoch: +1 on every join */
bit  up[N] = 1;           /* the node's process runs (0: crashed, until a new join) */
bit  dead[N];             /* NodeInfo.dead as the others see it (stale and silent heartbeat) */
bit  stalled[N];          /* paused (SIGSTOP, VM pause) longer than the liveness timeout */
bit  stale[N];            /* its own heartbeat is older than timeout / 2 (from a stall until the
                             first beat after it): the lease test of manager.py */
byte nstall[N];           /* stalls so far: a lease computed before a stall has lapsed */
bit  winw[N];             /* node's waiter: between check_token and its store (RESIDUAL_WINDOW) */
bit  inwin[N];            /* node's manager: between a check and the stores it guards */
bit  campaigning[N];      /* its LockManager is inside _elect (doorway to critical section) */
byte crashes, restarts, stalls, impatient;

/* private caches of the counter line (the only multi-writer line: handed over by the lock) */
byte c_ctr[N];
bit  c_dirty[N];

/* ---------------------------------------------------------------------- ghosts --------- */
bit  want[N];             /* the node's application wants the lock (until it released it) */
bit  incs[N];             /* between seeing the grant and releasing: "holds" the lock */
bit  revk[N];             /* its current grant was revoked (a revocation reached memory) */
byte done_cs;             /* critical sections whose write was published */
byte max_tok;             /* largest token that passed check_token so far */

/* mutual exclusion: at most one holder whose grant has not been revoked */
#define HOLDS(j) (incs[j] && !revk[j])
#if N == 2
#define NHOLD (HOLDS(0) + HOLDS(1))
#elif N == 3
#define NHOLD (HOLDS(0) + HOLDS(1) + HOLDS(2))
#else
#define NHOLD (HOLDS(0) + HOLDS(1) + HOLDS(2) + HOLDS(3))
#endif

#ifdef FIX_ELECTION_LAPSE
#define TICKET_OK(i) (!stale[i])   /* take a ticket only with a fresh heartbeat of my own */
#else
#define TICKET_OK(i) true
#endif

/* _follow: no lower candidate is live (dead nodes do not count) */
#define LOWEST_LIVE(i) ((i) == 0 || ((i) == 1 && dead[0]) || ((i) == 2 && dead[0] && dead[1]) \
                        || ((i) == 3 && dead[0] && dead[1] && dead[2]))

/* manager_valid(info, nodes): the recorded manager's node is not dead and has the epoch */
#define MGR_VALID (mg_node != 0 && !dead[mg_node - 1] && epoch[mg_node - 1] == mg_epoch)

#ifdef MUT_NO_RECHECK
#define RELEASED(h, hreq) (req_seq[h] == rel_seq[h])      /* "until slot == I" */
#else
#define RELEASED(h, hreq) (rel_seq[h] >= hreq)            /* manager_step: rel >= holder_req */
#endif

/* manager_step would grant node j: live, requesting, and not granted this request yet */
#define WANTS(j) (!dead[j] && req_seq[j] > rel_seq[j] && req_seq[j] > granted[j])
#if N == 2
#define ANY_WANTS (WANTS(0) || WANTS(1))
#elif N == 3
#define ANY_WANTS (WANTS(0) || WANTS(1) || WANTS(2))
#else
#define ANY_WANTS (WANTS(0) || WANTS(1) || WANTS(2) || WANTS(3))
#endif

/* slots.write_state: the stores into LOCK_STATE in the code's order, an early write-back of the
 * whole line possible after each (memory then holds the stores so far), then flush + fence.
 * An early write-back that the flush overwrites is seen only by a reader in between: check_token
 * (it compares holder and token) and a takeover (which follows the writer's death).  So the
 * branches are explored only while a crash can still follow (crashes < MAXCRASH), which keeps
 * every torn line a crash can leave behind, and every one a check_token can see.
 * `wrv` marks a revocation of holder `woh` (manager._revoke_dead): the ghost revk[woh] is set in
 * the step in which memory stops naming it. */
#define RV_GHOST(wrv, woh) if :: wrv -> revk[woh] = 1 :: else -> skip fi
#define TEAR (crashes < MAXCRASH)
/* `wclose`: the write ends the manager's window (a release or a revocation): the step that
 * publishes the line also forgets the holder (h = NONE) */
#define CLOSE(wclose) if :: wclose -> h = NONE; rv = 0; rl = 0; inwin[i] = 0 :: else -> skip fi
#ifdef MUT_NO_STATE_FLUSH
#define STATE_FLUSH(nh, nhreq, ntok, nrr, wrv, woh, wclose) atomic { CLOSE(wclose) }
#else
#define STATE_FLUSH(nh, nhreq, ntok, nrr, wrv, woh, wclose) \
  atomic { st_hreq = nhreq; st_tok = ntok; st_rr = nrr; st_holder = nh; RV_GHOST(wrv, woh); \
           CLOSE(wclose) }
#endif
#ifdef MUT_HOLDER_FIRST
inline write_state(nh, nhreq, ntok, nrr, wrv, woh, wclose) {
  /* holder, holder_req, token, ..., rr_cursor (the order before issue #17) */
  if :: TEAR -> atomic { st_holder = nh; RV_GHOST(wrv, woh) } :: skip fi;
  if :: TEAR -> atomic { st_holder = nh; st_hreq = nhreq; RV_GHOST(wrv, woh) } :: skip fi;
  STATE_FLUSH(nh, nhreq, ntok, nrr, wrv, woh, wclose)
}
#else
inline write_state(nh, nhreq, ntok, nrr, wrv, woh, wclose) {
  /* holder_req, token, ..., rr_cursor, then holder last: a torn line never names a holder
   * with another grant's request or token */
  if :: TEAR -> st_hreq = nhreq :: skip fi;
  if :: TEAR -> atomic { st_hreq = nhreq; st_tok = ntok } :: skip fi;
  STATE_FLUSH(nh, nhreq, ntok, nrr, wrv, woh, wclose)
}
#endif

/* slots.write_grant: token, term, granted_ns, then grant_seq last; flush + fence.  An early
 * write-back of the token alone is unobservable (the waiter reads it only once grant_seq
 * matches, a takeover reads grant_seq only), so the line is one step; it closes the window. */
inline write_grant(gj, nseq, ntok) {
  atomic { gr_tok[gj] = ntok; gr_seq[gj] = nseq; revk[gj] = 0;
           granted[gj] = nseq; inwin[i] = 0; found = 0; j = 0 }
}

/* GlobalLock.check_token -> slots.check_token: LOCK_STATE still names this node and token */
#ifdef FIX_HOLDER_LEASE
#define CHECK_TOKEN (st_holder == i + 1 && st_tok == tok && !stale[i])  /* and my lease holds */
#define FRESH_FAIL_OK (revk[i] || stale[i])
#else
#define CHECK_TOKEN (st_holder == i + 1 && st_tok == tok)
#define FRESH_FAIL_OK (revk[i])
#endif

/* ==================================================================== Waiter ============ */
proctype Waiter(byte i) provided (!stalled[i])
{
  byte myep, req, tok, v, cyc, tmo, c_req, c_rel;
  bit ok;

end_boot:
  do
  :: atomic { up[i] && epoch[i] != myep ->         /* a new process joined (NodeTable.join) */
              myep = epoch[i]; cyc = 0; tmo = 0;     /* a new process: nothing carries over */
              req = 0; tok = 0; v = 0; ok = 0; c_req = 0; c_rel = 0 }
     {
       do
       :: cyc < CYCLES ->
request:  /* slots.post_request: load_fresh(req_seq), load(rel_seq) (one line); withdraw what a
           * crashed process of this node left (W or L), then request.  Stores rel_seq, then
           * req_seq, then flush + fence: an early write-back may publish the withdrawal alone
           * (a step of its own only when there is a withdrawal: otherwise it changes nothing). */
          atomic {
            want[i] = 1;
            c_req = req_seq[i] + 1; c_rel = rel_seq[i];
            if
            :: c_rel < c_req - 1 -> c_rel = c_req - 1
            :: else -> rel_seq[i] = c_rel; req_seq[i] = c_req; req = c_req; c_req = 0; c_rel = 0
            fi
          };
          if
          :: req == 0 ->
             if :: rel_seq[i] = c_rel :: skip fi;
             atomic { rel_seq[i] = c_rel; req_seq[i] = c_req; req = c_req; c_req = 0; c_rel = 0 }
          :: else -> skip
          fi;
          /* GlobalLock._wait_grant over slots.poll_grant (grant_seq == req, then its token, one
           * line), GlobalLock._granted, the critical section's first check_token and its fresh
           * read of the protected line: steps of this process that nobody else observes */
          if
          :: atomic {
               gr_seq[i] == req ->
               tok = gr_tok[i];
               incs[i] = 1;
               ok = CHECK_TOKEN;
               if
               :: ok ->
                  assert(tok > max_tok);      /* tokens that pass check_token only grow */
                  max_tok = tok;
                  v = counter;
                  assert(v == done_cs)        /* every earlier holder's write is visible */
               :: else ->
                  assert(FRESH_FAIL_OK)       /* a fresh grant fails only if it was revoked */
               fi
             }
          :: tmo < MAXTMO ->                  /* LockTimeout: GlobalLock._withdraw, slots.release */
             atomic { tmo++; rel_seq[i] = req };
             goto request                     /* the caller tries again */
          fi;
          if
          :: ok ->
             /* the write batch: check_token, then the store and its flush.  The window between
              * the two is the residual window of slots.py (see WIN_OK). */
#ifdef MUT_NO_TOKEN_CHECK
             winw[i] = 1;
#else
             atomic { winw[i] = 1; ok = CHECK_TOKEN };
#endif
             atomic {
               if
               :: ok ->
                  assert(!revk[i]);           /* a revoked holder's write never lands */
#ifdef MUT_NO_CS_FLUSH
                  c_ctr[i] = v + 1; c_dirty[i] = 1;   /* published only by a later eviction */
#else
                  counter = v + 1;            /* store, flush, fence */
#endif
                  done_cs++
               :: else -> skip                /* LockRevoked: the write is refused */
               fi;
               winw[i] = 0; v = 0
             }
          :: else -> skip                     /* LockRevoked at the first check */
          fi;
          /* GlobalLock.release -> slots.release: rel_seq = req_seq, flush, fence */
          atomic {
            incs[i] = 0; want[i] = 0;
#ifdef MUT_NO_REL_FLUSH
            if :: rel_seq[i] = req :: skip fi;    /* visible only if the line is evicted */
#else
            rel_seq[i] = req;
#endif
            cyc++; req = 0; tok = 0; ok = 0
          }
       :: else -> break
       od
     } unless { epoch[i] != myep || !up[i] }
  od
}

/* ==================================================================== Manager =========== */
proctype Manager(byte i) provided (!stalled[i])
{
  byte myep, term, h, hreq, tok, seq, rr;    /* the manager's private state (st, term) */
  byte granted[N];                           /* last req_seq granted to each node */
  byte j, k, r1, top, mine, ls;              /* temporaries: reset after use (smaller state space) */
  bit lease, valid, rv, rl, found;
  byte act;                                  /* GO, FENCED, LOST: _still_manager's verdict */

end_boot:
  do
  :: atomic { up[i] && epoch[i] != myep ->           /* LockManager.run: _write_candidate(1,0,0) */
              myep = epoch[i]; ca_number[i] = 0;
              term = 0; h = 0; hreq = 0; tok = 0; seq = 0; rr = 0; k = 0; r1 = 0; top = 0;
              mine = 0; ls = 0; lease = 0; valid = 0; rv = 0; rl = 0; found = 0; act = GO;
              j = 0; do :: j < N -> granted[j] = 0; j++ :: else -> break od; j = 0 }
     {
end_follow:
       do
       :: /* _follow: poll the MANAGER line until manager_valid() is false.  The lowest live
           * candidate campaigns at once; a higher one only after liveness_timeout_s more, which
           * the model lets happen MAXIMPATIENT times in a run at any moment (so concurrent
           * campaigns are explored, without every schedule paying for them). */
          atomic {
            !MGR_VALID && (LOWEST_LIVE(i) || impatient < MAXIMPATIENT) && TICKET_OK(i) ->
            if :: !LOWEST_LIVE(i) -> impatient++ :: else -> skip fi;
            campaigning[i] = 1; ls = nstall[i]
          };
          /* _elect: Lamport's bakery over the MANAGER_CANDIDATE lines, dead nodes skipped.  The
           * doorway (choosing = 1; number = 1 + max of the live candidates'; choosing = 0) is one
           * step here: the bakery is correct with a non-atomic doorway, and the model checks
           * what surrounds it (the skip of dead nodes, the critical section, the takeover). */
          atomic {
            j = 0;
            do
            :: j < N ->
               if :: j != i && !dead[j] && ca_number[j] > top -> top = ca_number[j] :: else -> skip fi;
               j++
            :: else -> break
            od;
            mine = top + 1; ca_number[i] = mine; top = 0; j = 0
          };
          do
          :: atomic { j < N ->
               if
               :: j != i ->                    /* wait until j is dead or j's ticket is larger */
                  (dead[j] || ca_number[j] == 0 || ca_number[j] > mine ||
                   (ca_number[j] == mine && j > i))
               :: else -> skip
               fi;
               j++ }
          :: else -> break
          od;
          /* the election's critical section: re-read the node table and the MANAGER line; the
           * window until the MANAGER line is written opens here */
          atomic {
            j = 0; mine = 0; inwin[i] = 1;
            valid = MGR_VALID || dead[i];
#ifdef FIX_ELECTION_LAPSE
            valid = valid || stale[i] || ls != nstall[i];   /* I paused since the doorway: retry */
#endif
            ls = 0; campaigning[i] = 0;
            term = mg_term + 1
          };
          if
          :: valid -> atomic { inwin[i] = 0; ca_number[i] = 0; valid = 0; term = 0 }   /* follow */
          :: else ->
             atomic { mg_node = i + 1; mg_term = term; mg_epoch = epoch[i]; inwin[i] = 0 };  /* one line, flushed */
             ca_number[i] = 0;                 /* finally: _write_candidate(1, 0, 0) */
             /* _take_over: the state line (one read), then every grant line fresh */
             atomic {
               h = (st_holder == 0 -> NONE : st_holder - 1);
               hreq = st_hreq; tok = st_tok; rr = st_rr; seq = 0
             };
             atomic {
               j = 0;
               do
               :: j < N -> granted[j] = gr_seq[j]; j++
               :: else -> break
               od;
               j = 0
             };
             if
             :: h != NONE && granted[h] < hreq ->   /* old manager died between the two lines */
                write_grant(h, hreq, tok)
             :: else -> skip
             fi;
             /* _manage: an iteration per scan slice */
end_manage:
             do
             :: /* a scan that finds nothing to do changes nothing: wait for work instead.  Then, in
                 * one step: _manage's nodes() (the lease: my heartbeat younger than timeout / 2),
                 * _revoke_dead's or manager_step's decision on that read, and _still_manager
                 * (lease, then the MANAGER line) before the state line is written */
                atomic {
                  (h != NONE && (dead[h] || RELEASED(h, hreq))) || (h == NONE && ANY_WANTS) ->
                  lease = !stale[i]; ls = nstall[i];
#ifdef MUT_NO_REVOKE
                  rv = 0;                                       /* a dead holder keeps the lock */
#else
                  rv = (h != NONE && dead[h]);                  /* _revoke_dead */
#endif
                  rl = (!rv && h != NONE && RELEASED(h, hreq));  /* manager_step: rel >= holder_req */
                  act = GO;
                  if
                  :: rv || rl ->
                     if
                     :: !lease -> act = FENCED                  /* SLICE_SELF_FENCED */
#ifndef MUT_NO_TERM_CHECK
                     :: lease && (mg_term != term || mg_node != i + 1) -> act = LOST
#endif
                     :: else -> inwin[i] = 1                    /* the window opens */
                     fi
                  :: else -> skip
                  fi;
                  if :: act != GO -> rv = 0; rl = 0 :: else -> skip fi
                };
                if
                :: act == FENCED -> act = GO; goto next          /* sleep, next slice */
                :: act == LOST -> act = GO; break                /* _step_down */
                :: else -> skip
                fi;
                if
                :: rv -> write_state(0, hreq, tok, rr, 1, h, 1)  /* revoke: holder = 0 */
                :: rl -> write_state(0, hreq, tok, rr, 0, h, 1)  /* release noticed */
                :: else -> skip
                fi;
                /* manager_step: the next live waiter round-robin from rr_cursor + 1, then
                 * _still_manager.  The code reads one request line after the other; here the
                 * scan is one step (a request that appears mid-scan is seen or not, as at a
                 * slightly earlier or later scan) */
                atomic {
                  k = 1;
                  do
                  :: h == NONE && k <= N && !found ->          /* only while nobody holds it */
                     j = (rr + k) % N;
                     if :: WANTS(j) -> found = 1; r1 = req_seq[j] :: else -> k++; j = 0 fi
                  :: else -> break
                  od;
                  k = 0;
                  if
                  :: found ->
                     if
                     :: !(lease && ls == nstall[i]) -> act = FENCED
#ifndef MUT_NO_TERM_CHECK
                     :: lease && ls == nstall[i] && (mg_term != term || mg_node != i + 1) -> act = LOST
#endif
                     :: else ->                                  /* the window opens */
                        inwin[i] = 1; seq++; tok = TOKEN(term, seq); h = j; hreq = r1; rr = j
                     fi;
                     if :: act != GO -> found = 0; j = 0 :: else -> skip fi;
                     r1 = 0
                  :: else -> skip
                  fi;
                  ls = 0
                };
                if
                :: act == FENCED -> act = GO; goto next
                :: act == LOST -> act = GO; break
                :: found ->
                   write_state(j + 1, hreq, tok, rr, 0, 0, 0);  /* 1. the state names it */
                   write_grant(j, hreq, tok)                     /* 2. the grant */
                :: else -> skip
                fi;
next:           skip
             od;
             /* _step_down: back to following */
             atomic { term = 0; h = 0; hreq = 0; tok = 0; seq = 0; rr = 0; lease = 0; ls = 0;
                      j = 0; do :: j < N -> granted[j] = 0; j++ :: else -> break od; j = 0 }
          fi
       od
     } unless { epoch[i] != myep || !up[i] }
  od
}

/* ==================================================================== Env =============== */
#define ENV_NODE(i) \
  :: atomic { crashes < MAXCRASH && up[i] -> \
       up[i] = 0; stalled[i] = 0; stale[i] = 1; crashes++; \
       incs[i] = 0; want[i] = 0; inwin[i] = 0; winw[i] = 0; campaigning[i] = 0; c_dirty[i] = 0 } \
  :: atomic { !up[i] && !dead[i] -> dead[i] = 1 } \
  :: atomic { !up[i] && dead[i] && restarts < MAXRESTART -> \
       restarts++; epoch[i]++; dead[i] = 0; stale[i] = 0; up[i] = 1 } \
  :: atomic { stalls < MAXSTALL && up[i] && !stalled[i] && WIN_OK && CAMPAIGN_OK(i) -> \
       stalls++; stalled[i] = 1; stale[i] = 1; nstall[i]++ } \
  :: atomic { stalled[i] && !dead[i] && WIN_OK -> dead[i] = 1 } \
  :: atomic { stalled[i] && WIN_OK -> stalled[i] = 0; RESUME_BEAT(i) } \
  :: atomic { up[i] && !stalled[i] && stale[i] && WIN_OK -> stale[i] = 0; dead[i] = 0 } \
  :: atomic { c_dirty[i] -> counter = c_ctr[i]; c_dirty[i] = 0 }

/* The residual window (slots.py, manager.py): a check and the stores it guards are not atomic.
 * The protocol is correct only if no stall boundary of any node (a stall starting, the verdict
 * flipping, a resumption) falls inside an open check -> store window of any process. */
#if N == 2
#define NOWIN (!inwin[0] && !inwin[1] && !winw[0] && !winw[1])
#elif N == 3
#define NOWIN (!inwin[0] && !inwin[1] && !inwin[2] && !winw[0] && !winw[1] && !winw[2])
#else
#define NOWIN (!inwin[0] && !inwin[1] && !inwin[2] && !inwin[3] && \
               !winw[0] && !winw[1] && !winw[2] && !winw[3])
#endif
#ifdef RESIDUAL_WINDOW
#define WIN_OK true
#else
#define WIN_OK NOWIN
#endif

/* Two more assumptions the current code needs (issue #17 findings; -DOPEN_STALLS drops both):
 * A2: after a pause, the node's first heartbeat reaches memory before its other threads run
 *     (resumption and beat are one step).  Without it a resumed holder passes check_token while
 *     a revocation decided during its pause is in flight (FIX_HOLDER_LEASE closes it).
 * A3: a node does not pause inside an election.  Without it the bakery's skip of a dead
 *     candidate lets that candidate, once resumed, into the critical section next to the one
 *     that skipped it: two managers of one term (FIX_ELECTION_LAPSE closes it). */
#ifdef OPEN_STALLS
#define RESUME_BEAT(i) skip
#define CAMPAIGN_OK(i) true
#else
#define RESUME_BEAT(i) stale[i] = 0; dead[i] = 0
#define CAMPAIGN_OK(i) (!campaigning[i])
#endif

active proctype Env()
{
end_env:
  do
  ENV_NODE(0)
  ENV_NODE(1)
#if N >= 3
  ENV_NODE(2)
#endif
#if N >= 4
  ENV_NODE(3)
#endif
  od
}

/* mutual exclusion, checked in every state */
active proctype Mutex()
{
end_mutex:
  atomic { NHOLD > 1 -> assert(false) }
}

init {
  byte n;
  atomic {
    n = 0;
    do
    :: n < N ->
       if :: n < WAITERS -> run Waiter(n) :: else -> skip fi;   /* nodes 0..WAITERS-1 take the lock */
       run Manager(n); n++
    :: else -> break
    od
  }
}

/* progress: every lock attempt of a node ends (granted and released, or the node crashed) */
#ifdef PROGRESS
#if N == 2
ltl progress { [] ((want[0] -> <> !want[0]) && (want[1] -> <> !want[1])) }
#elif N == 3
ltl progress { [] ((want[0] -> <> !want[0]) && (want[1] -> <> !want[1]) && (want[2] -> <> !want[2])) }
#else
ltl progress { [] ((want[0] -> <> !want[0]) && (want[1] -> <> !want[1]) && (want[2] -> <> !want[2]) && (want[3] -> <> !want[3])) }
#endif
#endif
