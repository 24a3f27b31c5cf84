/* Faults on file maps turned into errors. A copy from a map whose file another process
   cut short touches pages that the file no longer has, and the kernel answers with
   SIGBUS, which kills the process; no check of the file's length before the copy can
   close the window between the check and the copy. So copies from maps run guarded
   (fastst_fault_guarded): a fault in a guarded copy ends the copy (siglongjmp out of
   the signal's handler) and the copy reports it, as the JVM does for its mapped
   buffers. Every other SIGBUS goes on to the handler there was before ours (Python's
   faulthandler, say) as the kernel would have called it, or does what SIGBUS does by
   default. */
#ifndef FASTST_FAULTS_H
#define FASTST_FAULTS_H

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

/* Thread-local, read in the handler: initial-exec, so that reading it there is a plain
   load (a dynamic TLS access may allocate, in a signal's handler). */
#if defined(__GNUC__)
#define FASTST_THREAD_LOCAL __thread __attribute__((tls_model("initial-exec")))
#else
#define FASTST_THREAD_LOCAL _Thread_local
#endif

/* Neither inlined nor specialised for its callback, so that sigsetjmp's rule (a local
   changed after it holds no known value after the jump back) bears on the guard's own
   locals alone, never on its callers' or its callback's. */
#if defined(__clang__)
#define FASTST_GUARD_ONLY __attribute__((noinline))
#elif defined(__GNUC__)
#define FASTST_GUARD_ONLY __attribute__((noinline, noclone))
#else
#define FASTST_GUARD_ONLY
#endif

#define FASTST_FAULT_BELOW 8     /* the other handlers kept, to chain to */
#define FASTST_FAULT_REPEATS 16  /* a handler chained to that leaves the same fault
                                    unmended this many times in a row is passed over */

static FASTST_THREAD_LOCAL sigjmp_buf *fastst_fault_jump;   /* set while guarded */
static FASTST_THREAD_LOCAL const char *fastst_fault_address;   /* the last one ended */
static FASTST_THREAD_LOCAL int fastst_fault_depth;   /* handlers chained to, nested */
static FASTST_THREAD_LOCAL const void *fastst_fault_last;   /* the last fault chained */
static FASTST_THREAD_LOCAL int fastst_fault_repeats;   /* ... and how often in a row */

/* The handlers found in SIGBUS's place when ours was put there, oldest first, each
   once; written under the lock, each entry before the count that publishes it. */
static struct sigaction fastst_fault_below[FASTST_FAULT_BELOW];
static int fastst_fault_below_count;
static pthread_mutex_t fastst_fault_lock = PTHREAD_MUTEX_INITIALIZER;

/* What SIGBUS does by default: the process ends. A fault (si_code > 0) faults again
   when the handler returns, now to the default; a signal sent is sent again. */
static void fastst_fault_default(int signal, const siginfo_t *info) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    sigaction(signal, &action, NULL);
    if (info->si_code <= 0) raise(signal);
}

/* Call `below` as the kernel would have: with its mask, reset first where it asked. */
static void fastst_fault_call(const struct sigaction *below, int signal, siginfo_t *info,
                              void *context) {
    sigset_t mask = below->sa_mask, before;
    if (below->sa_flags & SA_RESETHAND) {
        struct sigaction reset;
        memset(&reset, 0, sizeof reset);
        reset.sa_handler = SIG_DFL;
        sigemptyset(&reset.sa_mask);
        sigaction(signal, &reset, NULL);
    }
    if (!(below->sa_flags & SA_NODEFER)) sigaddset(&mask, signal);
    pthread_sigmask(SIG_BLOCK, &mask, &before);
    fastst_fault_depth++;
    if (below->sa_flags & SA_SIGINFO) below->sa_sigaction(signal, info, context);
    else below->sa_handler(signal);
    fastst_fault_depth--;
    pthread_sigmask(SIG_SETMASK, &before, NULL);
}

/* A SIGBUS not raised in a guarded copy: to the newest handler below ours, and to the
   next one down where that one calls ours again (faulthandler raises the signal again
   once it has put back the handler it found, ours where ours was there first); past
   the last, or where a handler leaves the same fault unmended again and again (one
   that no longer does anything: faulthandler disabled under ours), the default. A
   fault is never such a call again (a signal raised is no fault): it starts from the
   newest, whatever a handler that jumped out of an earlier one left. */
static void fastst_fault_chain(int signal, siginfo_t *info, void *context) {
    int saved = errno, count = __atomic_load_n(&fastst_fault_below_count, __ATOMIC_ACQUIRE);
    const struct sigaction *below = NULL;
    if (info->si_code > 0) fastst_fault_depth = 0;
    if (fastst_fault_depth < count)
        below = &fastst_fault_below[count - 1 - fastst_fault_depth];
    if (info->si_code > 0) {
        fastst_fault_repeats = info->si_addr == fastst_fault_last ? fastst_fault_repeats + 1 : 0;
        fastst_fault_last = info->si_addr;
        if (fastst_fault_repeats >= FASTST_FAULT_REPEATS) below = NULL;
    }
    if (below == NULL || below->sa_handler == SIG_DFL
            || (below->sa_handler == SIG_IGN && info->si_code > 0))
        fastst_fault_default(signal, info);     /* a fault is not ignored: it kills */
    else if (below->sa_handler != SIG_IGN)
        fastst_fault_call(below, signal, info, context);
    errno = saved;
}

static void fastst_fault_handler(int signal, siginfo_t *info, void *context) {
    sigjmp_buf *jump = fastst_fault_jump;
    if (jump != NULL && info->si_code > 0) {
        fastst_fault_jump = NULL;
        fastst_fault_address = (const char *)info->si_addr;
        siglongjmp(*jump, 1);
    }
    fastst_fault_chain(signal, info, context);
}

static int fastst_fault_ours(const struct sigaction *action) {
    return (action->sa_flags & SA_SIGINFO) && action->sa_sigaction == fastst_fault_handler;
}

/* Keep `found` below ours, unless it is kept already: 0, or -1 where there is no room
   left for it (under the lock). */
static int fastst_fault_keep(const struct sigaction *found) {
    int k, count = fastst_fault_below_count;
    for (k = 0; k < count; k++) {
        const struct sigaction *kept = &fastst_fault_below[k];
        if ((kept->sa_flags & SA_SIGINFO) == (found->sa_flags & SA_SIGINFO)
                && ((found->sa_flags & SA_SIGINFO)
                    ? kept->sa_sigaction == found->sa_sigaction
                    : kept->sa_handler == found->sa_handler))
            return 0;
    }
    if (count == FASTST_FAULT_BELOW) return -1;
    fastst_fault_below[count] = *found;
    __atomic_store_n(&fastst_fault_below_count, count + 1, __ATOMIC_RELEASE);
    return 0;
}

/* Make fastst_fault_handler SIGBUS's handler, where it is not (the first time, or
   another handler took its place since: faulthandler enabled later would otherwise
   see a guarded fault first, report it as fatal and end its watch); the handler found
   there is kept below it. Where FASTST_FAULT_BELOW handlers are kept already, a new
   one is left in place, ours below it. 0, or -1 where sigaction failed (errno). */
static int fastst_faults_catch(void) {
    struct sigaction now, ours, replaced;
    int error = 0;
    pthread_mutex_lock(&fastst_fault_lock);
    if (sigaction(SIGBUS, NULL, &now) != 0) {
        error = -1;
    } else if (!fastst_fault_ours(&now) && fastst_fault_keep(&now) == 0) {
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = fastst_fault_handler;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        if (sigaction(SIGBUS, &ours, &replaced) != 0) error = -1;
        else if (!fastst_fault_ours(&replaced)) fastst_fault_keep(&replaced);  /* set meanwhile */
    }
    pthread_mutex_unlock(&fastst_fault_lock);
    return error;
}

/* Run copy(argument) guarded: 0 once it returns, 1 where a fault (SIGBUS) ended it,
   `*address` then the address whose read faulted. What `copy` does may be cut short
   anywhere: it may hold no lock and allocate nothing, and the memory it writes is
   left as the fault found it. fastst_faults_catch must have put the handler in place
   (else a fault is the process's end, as before). */
static FASTST_GUARD_ONLY int fastst_fault_guarded(void (*copy)(void *), void *argument,
                                                  const char **address) {
    sigjmp_buf jump;
    sigjmp_buf *volatile outer = fastst_fault_jump;
    if (sigsetjmp(jump, 0) != 0) {      /* no mask to restore: SA_NODEFER */
        fastst_fault_jump = outer;
        *address = fastst_fault_address;
        return 1;
    }
    fastst_fault_jump = &jump;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    copy(argument);
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    fastst_fault_jump = outer;
    return 0;
}

#endif
