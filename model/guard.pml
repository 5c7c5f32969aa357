/*
 * The deadline protocol of sentinel-guard, for spin. `model/check` runs every configuration;
 * docs/design.md, "The protocol model", says what the model covers and what it leaves out.
 *
 * Actors: guard A, which holds the lock and runs its app; A's watchdog; A's app (its whole process
 * tree); the backend; and guard B, a `--wait` standby on another host, which takes the lock the
 * moment the backend grants it and starts its own app after its takeover delay. At most one fault
 * hits A, at any tick.
 *
 * Exactly one backend:
 *   -DSESSION   MySQL GET_LOCK / PostgreSQL advisory lock: the lock lives as long as the session,
 *               and the server ends a silent session after its timeout (wait_timeout,
 *               idle_session_timeout)
 *   -DLEASE     Redis: a key with a ttl, renewed; with -DETCD, etcd: the same lease, and the
 *               watchdog of a dead guard revokes it once the app is gone
 *   -DFLOCK     the lock file: the kernel frees the flock with the last descriptor, and the
 *               watchdog keeps one until the app is gone
 * Switches:
 *   -DZERO_DELAY  B runs with --takeover-delay 0s instead of auto
 *   -DNO_TAKEN    leaves out the fault "the backend takes the lock away"
 *   -DWITNESS     claims instead that hand-overs never happen (one claim per fault); they must
 *                 fail, or the model never reaches a hand-over and its safety proves nothing
 *   -DMUTANT      skips the check that the tick values obey the rules (mutants break them)
 * Mutants (with -DMUTANT; each must fail):
 *   -DSERVER_TIMEOUT=n  the server's session timeout, in ticks
 *   -DVALID=n           how long after its send a renewal is relied on, in ticks
 *   -DMONOTONIC         deadlines on CLOCK_MONOTONIC, which stops while the host is suspended
 *   -DNO_KEPT_FD        the watchdog keeps no copy of the locked file's descriptor
 *   -DRENEW=n           --renew-interval, in ticks
 *   -DNO_EXEC_CHECK     the app's process runs the command without reading the deadline's clock
 * And -DTHAW_RUNS, which must fail too: it lets a thawed app run before its guard and watchdog do,
 * the millisecond docs/guarantees.md measures, which the model otherwise puts below a tick.
 */

#if !defined(SESSION) && !defined(LEASE) && !defined(FLOCK)
#define SESSION
#endif

#define NEVER 255
#define MIN(a, b) ((a) < (b) -> (a) : (b))

/* ------------------------------------------------------------------------------------------------
 * Timings, in ticks, from the rules of src/config/timings.rs (Timings::validate and what it calls).
 * ---------------------------------------------------------------------------------------------- */

#ifdef SESSION
/* One tick is 1s: the session timeout is whole seconds (session_timeout_secs rounds up). */
#define TICK_MS 1000
#define I 1          /* --check-interval 1s, at least MIN_CHECK_INTERVAL 100ms */
#define T 2          /* --check-timeout 2s, at least MIN_CHECK_TIMEOUT 100ms */
#define G 1          /* --grace-period 1s */
#define CHUNK 2      /* MAX_LOCK_WAIT_CHUNK: a grant counts up to chunk + check-timeout after it was asked */
#define MARGIN 5     /* SESSION_SAFETY_MARGIN */
#define BUDGET (I + T)   /* detection_bound: a check counts if answered within interval + timeout */
#ifndef SERVER_TIMEOUT
/* session_timeout_secs: ceil(chunk + interval + 2 x timeout + grace + margin) = 13s */
#define SERVER_TIMEOUT (CHUNK + I + 2 * T + G + MARGIN)
#endif
/* worst_answer_to_deadline: the "app dead by" bound in the lock record (own_bound); chunk and
 * 2 x timeout for a primary demoted in place, which this model leaves out */
#define BOUND (CHUNK + I + 2 * T + G)
#define SLACK 1      /* the watchdog's 200ms after a healthy guard's stop, rounded up */
#ifndef HORIZON
#define HORIZON 40
#endif
#endif

#ifdef LEASE
/* One tick is 100ms: the drift margin is at least 100ms, so it is at least one tick. */
#define TICK_MS 100
#define TTL 10       /* --ttl 1s */
#define G 3          /* --grace-period 300ms */
#ifndef RENEW
#define RENEW 3      /* --renew-interval 300ms */
#endif
#define T 2          /* --check-timeout 200ms */
#ifndef VALID
/* lease_validity = ttl - lease_drift_margin = 1s - (1s / 100 + 100ms) = 890ms, rounded up to
 * 900ms: the model's guard relies on its lease 10ms longer than the real one. */
#define VALID 9
#endif
#define RETRY 2      /* a failed renewal is retried after min(renew-interval, 250ms), rounded down */
#define BOUND (TTL + G)  /* bound(): ttl + grace, the lease record's "app dead by" */
#define SLACK 2      /* the watchdog's 200ms */
#ifndef HORIZON
#define HORIZON 56
#endif
#endif

#ifdef FLOCK
/* One tick is 1s. The file backend has no deadline: the kernel keeps a frozen guard's flock. */
#define TICK_MS 1000
#define I 1          /* --check-interval 1s: how often the guard looks whether the path still names its file */
#define T 1          /* --check-timeout 1s, only part of the recorded bound here */
#define G 1          /* --grace-period 1s */
#define BOUND (I + T + G)  /* own_bound: detection_bound + grace */
#define SLACK 1
#ifndef HORIZON
#define HORIZON 20
#endif
#endif

/* ------------------------------------------------------------------------------------------------
 * Clocks. `now` is the true time: the backend's clock, and CLOCK_BOOTTIME on A's host. `mono` is
 * CLOCK_MONOTONIC on A's host, which stops while the host is suspended. A's guard and watchdog
 * measure every deadline on GNOW.
 * ---------------------------------------------------------------------------------------------- */

byte now;
byte mono;
#ifdef MONOTONIC
#define GNOW mono
#else
#define GNOW now
#endif
#define passed(d) ((d) != NEVER && GNOW >= (d))

/* ------------------------------------------------------------------------------------------------
 * The one fault, and whether it is over (thawed, resumed, healed).
 * ---------------------------------------------------------------------------------------------- */

mtype = { NOFAULT, KILL, STOP, TREE, SUSPEND, PART, TAKEN, WDKILL };
mtype fault = NOFAULT;
bool over;
/* SIGSTOP stops the guard alone; a cgroup freeze (docker pause) or a suspended host stops the
 * whole tree: guard, watchdog and app. */
#define frozen_guard ((fault == STOP || fault == TREE || fault == SUSPEND) && !over)
#define frozen_tree ((fault == TREE || fault == SUSPEND) && !over)
/* A partition between A's host and the server drops whatever would cross it. A frozen or
 * suspended host still gets its answers, into the socket or by retransmission after the resume:
 * the guard reads them late, and judges them by its clock. */
#define cut (fault == PART && !over)

/* ------------------------------------------------------------------------------------------------
 * Guard A, its app, its watchdog.
 * ---------------------------------------------------------------------------------------------- */

#define G_ACQ 0      /* asked for the lock, waits for the answer */
#define G_GRANTED 1  /* holds the lock; the app is not started yet */
#define G_FORK 2     /* has found the lock not lost, forks the watchdog and the app next */
#define G_RUN 3      /* supervises the app */
#define G_STOP 4     /* tears the app's tree down */
#define G_GONE 5     /* exited */
#define G_DEAD 6     /* SIGKILLed */
byte g = G_ACQ;
bool g_lost;         /* the lock watcher reported the lock lost */
byte g_sent;         /* GNOW when the outstanding request (grant, check, renewal) was sent */
byte g_proven;       /* session: proven_until, the latest moment a question may be counted from */
byte g_valid = NEVER;  /* lease: valid_until */
byte g_next;         /* lease: the next renewal; file: the next look at the path */
bool r_out;          /* lease: a renewal is outstanding */
byte g_dead_by = NEVER;  /* the app's deadline as published; the guard's deadline timer */
byte g_kill_by = NEVER;  /* teardown: SIGKILL then */
bool g_ours;         /* teardown: the lock is released afterwards (else only dropped) */
bool c_guard = true; /* the guard's descriptor of the lock: the session's socket, the locked file */

#define A_NONE 0
#define A_RUN 1
#define A_STOPPING 2 /* got the stop signal, still runs until it exits or is SIGKILLed */
#define A_DEAD 3
byte app_a = A_NONE;
bool a_started;
bool a_exited;       /* ended on its own (the normal end of a run) */
bool stop_asked;     /* the guard was asked to stop (SIGTERM, --max-runtime): it tears down, then releases */
#define a_alive (app_a == A_RUN || app_a == A_STOPPING)
/* A SIGKILLed process runs no more code: the model counts it dead at once. */
#define a_running (a_alive && !frozen_tree)

#define W_OFF 0
#define W_ON 1
#define W_GONE 2
byte wd = W_OFF;
byte wd_dead_by = NEVER;
bool wd_stopping;
bool wd_teardown;
bool wd_farewell = true;
bool wd_acted;       /* exited 10: it stopped the app of an unresponsive guard */
bool c_wd;           /* the watchdog's copy of the lock's descriptor */

#define M_DEADLINE 1
#define M_KILLBY 2
#define M_LOST 3
#define M_STANDDOWN 4
chan pipe = [4] of { byte, byte };

/* ------------------------------------------------------------------------------------------------
 * The network between A and the server: one request out, one answer back.
 * ---------------------------------------------------------------------------------------------- */

#define Q_ACQUIRE 1
#define Q_RENEW 2
#define Q_CHECK 3
bool q_flight;       /* a request on its way: it reaches the server at any of the server's steps
                      * until check-timeout after it was sent; later, its answer could not count */
byte q_kind;
byte q_sent_t;       /* true time it was sent */
bool q_fresh;        /* sent in this tick, not yet seen by the server */
bool n_flight;       /* the answer on its way, arriving at n_at */
byte n_at;
bool n_val;          /* granted, owned, renewed */
bool sock;           /* the guard's step read an answer that had arrived (cleared after the step) */
bool sock_val;

/* ------------------------------------------------------------------------------------------------
 * The backend.
 * ---------------------------------------------------------------------------------------------- */

#define L_FREE 0
#define L_A 1
#define L_B 2
byte owner = L_FREE; /* session: who holds the named lock; lease: whose token the key holds */
bool s_open;         /* session: A's session is open on the server */
bool s_busy;         /* session: A's check runs (its SLEEP) */
byte s_wake;         /* session: when that SLEEP ends */
byte s_idle;         /* session: when the server sent A its last answer */
byte k_exp = NEVER;  /* lease: when the key expires, on the server's clock */
byte inode = 1;      /* file: the file the path names (2: made anew after the path was deleted) */
bool unlocked;       /* file: LOCK_UN, which frees the flock whatever copies of the descriptor are open */

/* The lock record A leaves for the next holder: its row, its lease record or clean marker, the
 * lock line of its lock file. */
#define R_NONE 0
#define R_HELD 1
#define R_RELEASED 2
#define R_TREE_GONE 3
byte rec = R_NONE;

/* ------------------------------------------------------------------------------------------------
 * Standby B.
 * ---------------------------------------------------------------------------------------------- */

#define B_WAIT 0
#define B_DELAY 1
#define B_RUN 2
byte b = B_WAIT;
bool b_armed;        /* B is started once A holds the lock, so B queues behind A */
byte b_at;
bool app_b;

/* ------------------------------------------------------------------------------------------------
 * Ticks. Each tick the clock moves (and the environment picks the fault and what the app does),
 * then the server takes its step, then guard, watchdog and standby take theirs, in every order.
 * The watchdog and the server also wake within the tick for a message just sent to them.
 * ---------------------------------------------------------------------------------------------- */

#define P_SERVER 0
#define P_GUARD 1
#define P_WD 2
#define P_STANDBY 3
/* all true until start() has set the scene */
bool stepped[4] = true;
#define all_stepped (stepped[0] && stepped[1] && stepped[2] && stepped[3])

/* ------------------------------------------------------------------------------------------------
 * The properties.
 * ---------------------------------------------------------------------------------------------- */

/* "Never two alive" is not claimed when the whole tree was frozen: the frozen app cannot be
 * killed until the thaw, and a standby may run by then (docs/guarantees.md, "Frozen or suspended
 * past the deadline"). "Never two running" is claimed for every fault. */
#define froze_tree (fault == TREE || fault == SUSPEND)
#ifdef WITNESS
/* Each claims that some hand-over never happens; model/check expects each to fail (pan -N name):
 * B's app runs after A's app ran, and, for each fault, after A's app was ended under that fault
 * by the protocol (not by its own exit, nor by a stop the guard was asked for). */
ltl handover { [] !(app_b && a_started) }
#define after(f) (app_b && a_started && !a_exited && !stop_asked && fault == f)
ltl after_kill { [] !after(KILL) }
ltl after_stop { [] !after(STOP) }
ltl after_tree { [] !after(TREE) }
ltl after_suspend { [] !after(SUSPEND) }
ltl after_part { [] !after(PART) }
ltl after_taken { [] !after(TAKEN) }
ltl after_wdkill { [] !after(WDKILL) }
#else
/* both, as one claim for one search; model/check tells a violation of which from the first */
#define two_running (a_running && app_b)
#define two_alive (a_alive && app_b && !froze_tree)
ltl safety { [] !(two_running || two_alive) }
ltl running { [] !two_running }
ltl alive { [] !two_alive }
#endif

/* ------------------------------------------------------------------------------------------------
 * The app's tree, as the guard and the watchdog signal it.
 * ---------------------------------------------------------------------------------------------- */

inline kill_app() {
	if
	:: a_alive -> app_a = A_DEAD
	:: else -> skip
	fi
}

inline stop_app() {
	if
	:: app_a == A_RUN -> app_a = A_STOPPING
	:: else -> skip
	fi
}

/* A message down the watchdog's pipe; once the watchdog has exited, the write fails (EPIPE). */
inline tell(tag, at) {
	if
	:: wd == W_ON -> assert(len(pipe) < 4); pipe!tag,at
	:: else -> skip
	fi
}

/* The watchdog exits; its copies of the lock's descriptor close with it, the pipe's unread
 * messages with them. */
inline wd_exit() {
	wd = W_GONE;
	c_wd = false;
	wd_dead_by = NEVER;
	wd_stopping = false;
	wd_teardown = false;
	wd_farewell = true;
	do
	:: len(pipe) > 0 -> pipe?m_tag,m_at
	:: else -> break
	od;
	m_tag = 0;
	m_at = 0
}
byte m_tag;
byte m_at;

/* ------------------------------------------------------------------------------------------------
 * Backend operations as the guard and the watchdog use them.
 * ---------------------------------------------------------------------------------------------- */

/* A's session ends on the server, and with it the lock it holds. */
inline session_ends() {
	s_open = false;
	s_busy = false;
	s_wake = 0;
	s_idle = 0;
	q_sent_t = 0;
	owner = (owner == L_A -> L_FREE : owner)
}

/* Gives the lock back after the tree is gone: the record says released first. */
inline release() {
#ifdef SESSION
	if
	:: !cut && owner == L_A && s_open -> rec = R_RELEASED; session_ends()
	:: else -> skip   /* cut off: the server ends the silent session after its timeout */
	fi
#endif
#ifdef LEASE
	if
	:: !cut && owner == L_A -> rec = R_RELEASED; owner = L_FREE; k_exp = NEVER
	:: else -> skip   /* cut off, or no longer ours: the key expires */
	fi
#endif
#ifdef FLOCK
	rec = R_RELEASED;
	unlocked = true
#endif
}

/* The watchdog of a dead guard, once the app's tree is gone. */
inline farewell() {
#ifdef SESSION
	/* KILL CONNECTION / pg_terminate_backend, only while the session still holds the lock; the
	 * record says tree_gone first */
	if
	:: !cut && owner == L_A && s_open -> rec = R_TREE_GONE; session_ends()
	:: else -> skip
	fi
#endif
#if defined(LEASE) && defined(ETCD)
	/* the lease is revoked, the record says tree_gone */
	if
	:: !cut && owner == L_A -> rec = R_TREE_GONE; owner = L_FREE; k_exp = NEVER
	:: else -> skip
	fi
#endif
	/* Redis: nothing, the key expires. File: closing the kept descriptor is the farewell. */
	skip
}

/* ------------------------------------------------------------------------------------------------
 * Guard A: one step.
 * ---------------------------------------------------------------------------------------------- */

/* The lock watcher publishes a new deadline. A deadline that has passed is final. */
#define publish(d) \
	if \
	:: !passed(g_dead_by) -> g_dead_by = (d); tell(M_DEADLINE, g_dead_by) \
	:: else -> skip \
	fi

/* An answer that has arrived is read; one that arrives into a partition is lost. A frozen guard
 * reads its answers when it runs again. */
inline read_answer() {
	if
	:: n_flight && now >= n_at -> n_flight = false; n_at = 0; sock = !cut; sock_val = n_val
	:: else -> skip
	fi
}

inline send(kind) {
	q_kind = kind;
	q_sent_t = now;
	g_sent = GNOW;
	/* a request sent into a partition is lost */
	q_flight = !cut;
	q_fresh = q_flight
}

/* The guard's teardown: the stop signal to the whole tree, SIGKILL at
 * kill_by = min(now + grace, lock deadline). */
inline teardown(ours) {
	if
	:: !ours -> tell(M_LOST, 0)
	:: else -> skip
	fi;
	stop_app();
	g_kill_by = MIN(GNOW + G, g_dead_by);
	tell(M_KILLBY, g_kill_by);
	g_ours = ours;
	g = G_STOP
}

/* A guard that exited or died keeps nothing: its timers and descriptors are gone. Its last
 * request is dropped too; had it reached the server, it would only keep the lock there longer. */
inline guard_clear() {
	c_guard = false;
	n_flight = false;
	n_at = 0;
	q_flight = false;
	q_fresh = false;
	g_lost = false;
	g_sent = 0;
	g_proven = 0;
	g_valid = NEVER;
	g_next = 0;
	r_out = false;
	g_dead_by = NEVER;
	g_kill_by = NEVER;
	g_ours = false
}

/* The tree is gone: stand the watchdog down, give the lock back or drop it, exit. */
inline tree_gone() {
	tell(M_STANDDOWN, 0);
	if
	:: g_ours -> release()
	:: else -> skip
	fi;
	g = G_GONE;
	guard_clear()
}

/* A passed deadline, or a watchdog that acted: SIGKILL now, no grace. */
inline kill_now() {
	kill_app();
	tell(M_LOST, 0);
	g_ours = false;
	tree_gone()
}

#ifdef SESSION
/* The watcher's next check: its deadline counts from min(sent, proven_until). */
inline send_check() {
	send(Q_CHECK);
	publish(MIN(g_sent, g_proven) + BUDGET + G)
}

inline acquire_step() {
	if
	:: sock ->
		sock = false;
		if
		:: GNOW - g_sent > CHUNK + T ->
			/* answered too late to rely on: the session is closed, which frees the lock */
			g = G_GONE; guard_clear()
		:: else ->
			rec = R_HELD;
			/* asked = sent + chunk: the server may count the session idle from the grant on */
			g_proven = g_sent + CHUNK + T;
			g_dead_by = g_sent + CHUNK + BUDGET + G;
			send_check();
			g = G_GRANTED
		fi
	:: else ->
		if
		:: GNOW >= g_sent + CHUNK + T -> g = G_GONE; guard_clear()   /* no answer in time */
		:: else -> skip
		fi
	fi
}

inline watcher_step() {
	if
	:: g_lost || g == G_STOP -> skip
	:: sock ->
		sock = false;
		if
		:: GNOW - g_sent > BUDGET || !sock_val -> g_lost = true   /* late: proves nothing now */
		:: else -> g_proven = g_sent + BUDGET; send_check()
		fi
	:: !sock && !s_open && !cut -> g_lost = true       /* the server ended the session */
	:: else ->
		if
		:: GNOW >= g_sent + BUDGET -> g_lost = true    /* no answer within the budget */
		:: else -> skip
		fi
	fi
}
#endif

#ifdef LEASE
inline acquire_step() {
	if
	:: sock ->
		sock = false;
		if
		:: !sock_val -> g = G_GONE; guard_clear()   /* held by another: A would wait, out of scope */
		:: GNOW - g_sent > T -> send(Q_ACQUIRE)          /* late: asked again, the script extends our own key */
		:: else ->
			g_valid = g_sent + VALID;
			g_dead_by = g_valid;
			g_next = g_sent + RENEW;
			g = G_GRANTED
		fi
	:: else ->
		if
		:: GNOW >= g_sent + T -> n_flight = false; n_at = 0; send(Q_ACQUIRE)   /* no answer: asked again */
		:: else -> skip
		fi
	fi
}

inline watcher_step() {
	if
	:: g_lost || g == G_STOP -> skip
	:: GNOW + G >= g_valid -> g_lost = true   /* stop_at = valid_until - grace: first */
	:: else ->
		if
		:: r_out && sock ->
			sock = false;
			r_out = false;
			if
			:: !sock_val -> g_lost = true                      /* not owner */
			:: GNOW - g_sent > T -> g_next = GNOW + RETRY        /* confirmed too late: failed */
			:: else ->
				g_valid = g_sent + VALID;
				publish(g_valid);
				g_next = g_sent + RENEW
			fi
		:: r_out && !sock && GNOW >= g_sent + T ->
			/* no answer: the connection is dropped, its answer never counts */
			r_out = false;
			n_flight = false;
			n_at = 0;
			g_next = GNOW + RETRY
		:: else -> skip
		fi;
		if
		:: !g_lost && !r_out && GNOW >= g_next -> r_out = true; send(Q_RENEW)
		:: else -> skip
		fi
	fi
}
#endif

#ifdef FLOCK
inline watcher_step() {
	if
	:: g_lost || g == G_STOP -> skip
	:: GNOW >= g_next ->
		g_next = GNOW + I;
		if
		:: inode != 1 -> g_lost = true   /* the path no longer names the locked file */
		:: else -> skip
		fi
	:: else -> skip
	fi
}
#endif

inline supervise_step() {
	if
	:: g == G_GRANTED ->
		if
		:: g_lost -> g_ours = false; tree_gone()  /* lost before the app started: not started */
		:: else -> g = G_FORK   /* a freeze may come between this look and the fork */
		fi
	:: g == G_FORK ->
		/* the watchdog first, with the first deadline; then the app, whose process reads the
		 * clock itself and does not run the command once that deadline has passed */
		wd = W_ON;
#ifndef NO_KEPT_FD
		c_wd = true;
#endif
		if
		:: g_dead_by != NEVER -> tell(M_DEADLINE, g_dead_by)
		:: else -> skip
		fi;
		if
#ifndef NO_EXEC_CHECK
		:: passed(g_dead_by) -> g_ours = false; tree_gone()
#endif
		:: else -> app_a = A_RUN; a_started = true; g = G_RUN
		fi
	:: g == G_RUN ->
		if
		:: passed(g_dead_by) -> kill_now()         /* the deadline timer first (biased) */
		:: else ->
			if
			:: wd_acted -> kill_now()              /* the watchdog stopped the app: guard_frozen */
			:: app_a == A_DEAD -> g_ours = true; tree_gone()   /* the app ended: a clean release */
			:: wd == W_GONE -> teardown(true)      /* watchdog_died: stop the app, then release */
			:: g_lost -> teardown(false)
			:: stop_asked -> teardown(true)
			:: else -> skip
			fi
		fi
	:: g == G_STOP ->
		if
		:: app_a == A_DEAD -> tree_gone()
		:: GNOW >= g_kill_by -> kill_app(); tree_gone()
		:: else -> skip
		fi
	:: else -> skip
	fi
}

active proctype guard() {
end_guard:
	do
	:: d_step {
		stepped[P_SERVER] && !stepped[P_GUARD] ->
		if
		:: g == G_GONE || g == G_DEAD || frozen_guard -> skip
		:: else -> read_answer()
		fi;
		if
		:: g == G_GONE || g == G_DEAD || frozen_guard -> skip
		:: g == G_ACQ ->
#ifndef FLOCK
			acquire_step()
#else
			skip
#endif
		:: else -> watcher_step(); supervise_step()
		fi;
		sock = false;
		sock_val = false;
		stepped[P_GUARD] = true
	}
	od
}

/* ------------------------------------------------------------------------------------------------
 * The watchdog: the clock first, after every wake-up, then the messages in order, then the end
 * of the pipe (src/supervisor/watchdog.rs, `watch` and `Switch`).
 * ---------------------------------------------------------------------------------------------- */

/* stop_at = min(dead_by - grace + slack, dead_by) */
#define wd_stop_at (MIN((wd_dead_by + SLACK >= G -> wd_dead_by + SLACK - G : 0), wd_dead_by))

/* One wake-up of the watchdog: the clock first, then each message in order, then the end of the
 * pipe. */
inline wd_wake() {
	do
	:: wd != W_ON || frozen_tree -> break
	:: else ->
		if
		:: passed(wd_dead_by) ->
			kill_app();
			if
			:: wd_teardown -> wd_dead_by = NEVER   /* backs up a guard that is tearing down */
			:: else -> wd_acted = true; wd_exit()
			fi
		:: else ->
			if
			:: !wd_stopping && wd_dead_by != NEVER && GNOW >= wd_stop_at ->
				stop_app(); wd_stopping = true
			:: else ->
				if
				:: len(pipe) > 0 ->
					pipe?m_tag,m_at;
					if
					:: m_tag == M_DEADLINE && !wd_stopping -> wd_dead_by = m_at
					:: m_tag == M_KILLBY ->
						wd_stopping = true; wd_teardown = true;
						wd_dead_by = MIN(wd_dead_by, m_at)
					:: m_tag == M_LOST -> wd_farewell = false
					:: m_tag == M_STANDDOWN -> wd_exit()
					:: else -> skip
					fi;
					m_tag = 0;
					m_at = 0
				:: else ->
					/* the end of the pipe: the guard died. SIGKILL the group, wait until none
					 * of it is alive, then the farewell. */
					if
					:: g == G_DEAD ->
						kill_app();
						if
						:: wd_farewell -> farewell()
						:: else -> skip
						fi;
						wd_exit()
					:: else -> skip
					fi;
					break
				fi
			fi
		fi
	od;
	skip   /* where the loop's break lands, inside the d_step */
}

/* The watchdog sleeps in poll(2) on its pipe and a timer: it wakes at every tick for its timer,
 * and at once whenever the guard writes to the pipe or dies. The clock waits for that. */
#define wd_woken (wd == W_ON && !frozen_tree && (len(pipe) > 0 || g == G_DEAD))

active proctype watchdog() {
end_watchdog:
	do
	:: d_step { stepped[P_SERVER] && !stepped[P_WD] -> wd_wake(); stepped[P_WD] = true }
	:: d_step { stepped[P_WD] && wd_woken -> wd_wake() }
	od
}

/* ------------------------------------------------------------------------------------------------
 * The server.
 * ---------------------------------------------------------------------------------------------- */


/* The answer's arrival: any time until the request's budget is spent, measured from its send. */
#define answer(val, budget) \
	n_val = val; \
	n_flight = true; \
	n_at = now; \
	do \
	:: n_at < q_sent_t + (budget) -> n_at++ \
	:: break \
	od; \
	q_sent_t = 0

/* A request reaches the server: processed now. */
inline arrive() {
	q_flight = false;
#ifdef SESSION
	if
	:: s_open && !cut -> s_busy = true; s_wake = now + I   /* the check's SLEEP */
	:: else -> q_sent_t = 0                               /* lost in the partition, or too late */
	fi
#endif
#ifdef LEASE
	if
	:: cut -> q_sent_t = 0
	:: else ->
		if
		:: q_kind == Q_ACQUIRE && owner == L_FREE ->
			owner = L_A; k_exp = now + TTL; rec = R_HELD; b_armed = true; answer(true, T)
		:: else ->
			if
			:: owner == L_A -> k_exp = now + TTL; answer(true, T)   /* our token: extended */
			:: else -> answer(false, T)
			fi
		fi
	fi
#endif
}

/* A request on its way arrives now, or stays on its way while its answer could still count. */
inline maybe_arrive() {
	if
	:: q_flight && now < q_sent_t + T ->
		if
		:: arrive()
		:: skip
		fi
	:: q_flight -> arrive()
	:: else -> skip
	fi
}

/* The server's step comes first in each tick, so what it sends at a tick has arrived when the
 * guard's timer for that tick fires (an answer due at the timeout's instant counts, as tokio's
 * timeout polls the answer before its timer). It wakes again at once for a request just sent. */
active proctype server() {
end_server:
	do
	:: atomic {
		!stepped[P_SERVER] ->
#ifdef SESSION
		/* The session ends when it was silent for the timeout, or when every copy of the
		 * client's socket has closed (noticed at once here: later would only free it later). */
		if
		:: s_open && !s_busy && now >= s_idle + SERVER_TIMEOUT -> session_ends()
		:: else ->
			if
			:: s_open && !c_guard && !c_wd && !cut -> session_ends()
			:: else -> skip
			fi
		fi;
#endif
#ifdef LEASE
		/* Redis expires the key on its own clock. */
		if
		:: owner == L_A && now >= k_exp -> owner = L_FREE; k_exp = NEVER
		:: else -> skip
		fi;
#endif
		maybe_arrive();
#ifdef SESSION
		if
		:: s_busy && now >= s_wake ->
			s_busy = false;
			s_wake = 0;
			if
			:: s_open && owner == L_A -> s_idle = now; answer(true, BUDGET)
			:: s_open && owner != L_A -> s_idle = now; answer(false, BUDGET)
			:: else -> skip
			fi
		:: else -> skip
		fi;
#endif
		stepped[P_SERVER] = true
	}
	:: atomic { stepped[P_SERVER] && q_fresh -> q_fresh = false; maybe_arrive() }
	od
}

/* ------------------------------------------------------------------------------------------------
 * Standby B: takes the lock the moment it is free, waits its takeover delay, starts its app.
 * ---------------------------------------------------------------------------------------------- */

#ifdef ZERO_DELAY
#define takeover_delay 0
#else
/* --takeover-delay auto: no wait when the record proves the previous app gone, else its bound */
#ifdef SESSION
#define takeover_delay ((rec == R_RELEASED || rec == R_TREE_GONE) -> 0 : BOUND)
#endif
#ifdef LEASE
#define takeover_delay ((rec == R_RELEASED || rec == R_TREE_GONE) -> 0 : BOUND)
#endif
#ifdef FLOCK
/* a held line in the very file it now holds: the kernel freed the flock only with the
 * watchdog's copy, so the tree is gone; a new file has no record */
#define takeover_delay ((inode == 1) -> 0 : BOUND)
#endif
#endif

#ifdef FLOCK
#define locked (inode == 1 && (c_guard || c_wd) && !unlocked)
#endif

active proctype standby() {
end_standby:
	do
	:: d_step {
		stepped[P_SERVER] && !stepped[P_STANDBY] ->
		if
		:: b == B_WAIT && b_armed ->
#if defined(SESSION) || defined(LEASE)
			if
			:: owner == L_FREE -> owner = L_B; b_at = now + takeover_delay; b = B_DELAY; rec = R_NONE
			:: else -> skip
			fi
#endif
#ifdef FLOCK
			if
			:: !locked -> b_at = now + takeover_delay; b = B_DELAY; rec = R_NONE
			:: else -> skip
			fi
#endif
		:: else -> skip
		fi;
		if
		:: b == B_DELAY && now >= b_at -> app_b = true; b = B_RUN; b_at = 0
		:: else -> skip
		fi;
		stepped[P_STANDBY] = true
	}
	od
}

/* ------------------------------------------------------------------------------------------------
 * The clock and the environment.
 * ---------------------------------------------------------------------------------------------- */

inline take_away() {
#if defined(SESSION) || defined(LEASE)
	owner = L_FREE;     /* KILL CONNECTION, pg_terminate_backend, DEL, a restart that lost it */
#endif
#ifdef SESSION
	session_ends();
#endif
#ifdef LEASE
	k_exp = NEVER;
#endif
#ifdef FLOCK
	inode = 2;          /* the path deleted or replaced */
#endif
	skip
}

#if defined(SESSION) || defined(LEASE)
#define holds_a (owner == L_A)
#endif
#ifdef FLOCK
#define holds_a (inode == 1 && (g == G_GRANTED || g == G_FORK || g == G_RUN || g == G_STOP))
#endif

inline environment() {
	/* The app's own doing: it may end by itself, or on the stop signal, at any tick. */
	if
	:: app_a == A_RUN && !frozen_tree ->
		if
		:: skip
		:: app_a = A_DEAD; a_exited = true
		fi
	:: app_a == A_STOPPING && !frozen_tree ->
		if
		:: skip
		:: app_a = A_DEAD
		fi
	:: else -> skip
	fi;
	/* An operator's stop, or --max-runtime: a teardown while the lock is still ours, which a
	 * fault may then interrupt. */
	if
	:: g == G_RUN && !stop_asked ->
		if
		:: skip
		:: stop_asked = true
		fi
	:: else -> skip
	fi;
	if
	:: fault == NOFAULT && g != G_GONE ->
		if
		:: skip
		:: g != G_DEAD -> fault = KILL; g = G_DEAD; guard_clear()
		:: fault = STOP
		:: fault = TREE
#ifndef FLOCK
		/* a suspend of the guard's host, and a partition, mean nothing to a local flock */
		:: fault = SUSPEND
		:: fault = PART
#endif
#ifndef NO_TAKEN
		:: holds_a -> fault = TAKEN; take_away()
#endif
		:: wd == W_ON -> fault = WDKILL; wd_exit()
		fi
	:: !over && (fault == STOP || fault == TREE || fault == SUSPEND || fault == PART) ->
		if
		:: skip
		:: true ->
			/* The thaw. Whichever of guard and watchdog runs first SIGKILLs the app if a
			 * deadline has passed; the millisecond before that lands is below a tick
			 * (-DTHAW_RUNS lets the app run first, to show that millisecond). */
			if
#ifndef THAW_RUNS
			:: froze_tree && a_alive && ((g == G_RUN && passed(g_dead_by)) ||
			                             (g == G_STOP && GNOW >= g_kill_by) ||
			                             (wd == W_ON && passed(wd_dead_by))) ->
				app_a = A_DEAD
#endif
			:: else -> skip
			fi;
			over = true
		fi
	:: else -> skip
	fi
}

/* The tick values obey the rules of src/config/timings.rs, computed in milliseconds as there. */
#define ms(ticks) ((ticks) * TICK_MS)
inline rules() {
#ifndef MUTANT
	/* Timings::validate: MIN_CHECK_TIMEOUT */
	assert(ms(T) >= 100);
#ifdef SESSION
	/* Timings::validate: MIN_CHECK_INTERVAL */
	assert(ms(I) >= 100);
	/* session_timeout_secs = ceil(MAX_LOCK_WAIT_CHUNK + interval + 2 x timeout + grace +
	 * SESSION_SAFETY_MARGIN), in whole seconds */
	assert(ms(SERVER_TIMEOUT) == 2000 + ms(I) + 2 * ms(T) + ms(G) + 5000);
	assert(ms(CHUNK) == 2000 && ms(MARGIN) == 5000);
	/* own_bound = worst_answer_to_deadline: chunk + interval + 2 x timeout + grace */
	assert(BOUND == CHUNK + I + 2 * T + G)
#endif
#ifdef LEASE
	/* lease_validity = ttl - lease_drift_margin, margin = ttl / 100 + 100ms; rounded up to a
	 * tick, never by a whole one */
	assert(ms(VALID) >= ms(TTL) - (ms(TTL) / 100 + 100));
	assert(ms(VALID) < ms(TTL) - (ms(TTL) / 100 + 100) + TICK_MS);
	/* validate_lease: renew-interval > 0, ttl > margin + grace, and
	 * ttl - margin - grace >= renew-interval + check-timeout, unrounded and in ticks */
	assert(RENEW > 0 && ms(TTL) > ms(TTL) / 100 + 100 + ms(G));
	assert(ms(TTL) - (ms(TTL) / 100 + 100) - ms(G) >= ms(RENEW) + ms(T));
	assert(VALID - G >= RENEW + T);
	/* the retry after a failed renewal: min(renew-interval, 250ms), rounded down */
	assert(ms(RETRY) <= 250 && ms(RETRY) > 250 - TICK_MS && ms(RENEW) >= 250);
	/* bound = ttl + grace */
	assert(BOUND == TTL + G)
#endif
#ifdef FLOCK
	/* Timings::validate: MIN_CHECK_INTERVAL; own_bound = detection_bound + grace */
	assert(ms(I) >= 100);
	assert(BOUND == I + T + G)
#endif
#endif
	skip
}

inline start() {
	rules();
#ifdef SESSION
	/* A's GET_LOCK(name, chunk) is sent at 0 and granted at once: a later grant only starts the
	 * server's idle clock later. Its answer may arrive as late as chunk + check-timeout. */
	owner = L_A;
	b_armed = true;
	s_open = true;
	s_idle = 0;
	q_sent_t = 0;
	answer(true, CHUNK + T);
#endif
#ifdef LEASE
	q_flight = true;
	q_fresh = true;
	q_kind = Q_ACQUIRE;
#endif
#ifdef FLOCK
	/* flock(LOCK_NB) succeeds at 0; the lock line says held before the app can start */
	rec = R_HELD;
	b_armed = true;
	g = G_GRANTED;
	g_next = I;
#endif
	stepped[0] = false;
	stepped[1] = false;
	stepped[2] = false;
	stepped[3] = false
}

/* Nothing of A can run again and B's app runs: the rest of the horizon would change nothing. */
#define finished (!a_alive && (g == G_GONE || g == G_DEAD) && wd != W_ON && b == B_RUN)

active proctype clock() {
	atomic { start() };
end_clock:
	do
	:: atomic {
		all_stepped && !wd_woken && !q_fresh && now < HORIZON && !finished ->
		now++;
#ifdef MONOTONIC
		if
		:: fault == SUSPEND && !over -> skip   /* CLOCK_MONOTONIC stops while suspended */
		:: else -> mono++
		fi;
#endif
		environment();
		stepped[0] = false;
		stepped[1] = false;
		stepped[2] = false;
		stepped[3] = false
	}
	:: d_step {
		all_stepped && !wd_woken && !q_fresh && (now == HORIZON || finished) ->
		/* With no fault, an app that neither ended nor was asked to stop runs to the end: the
		 * rules let a healthy guard keep its lock. */
		assert(fault != NOFAULT || a_exited || stop_asked || app_a == A_RUN)
	} -> break
	od
}
