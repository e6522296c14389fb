package org.torchrecserve.plugin;

import java.util.Map;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ExecutionException;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;
import org.pytorch.serve.http.RequestTimeoutException;
import org.pytorch.serve.http.ServiceUnavailableException;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.messages.RequestInput;
import org.pytorch.serve.util.messages.WorkerCommands;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;

/**
 * A describe call to whichever worker of a model takes it first, answered into a future: the
 * worker's description (our handler answers with its pid, artifact, load time, ...).
 *
 * <p>Also the way to wake a worker that waits idle for work: it takes the describe, answers, and
 * comes back to its loop, where it sees that it was asked to stop (see {@link Drain}).
 */
final class DescribeJob extends Job {
    /** The header that makes a worker's handler answer with its description, not scores. */
    static final String DESCRIBE_HEADER = "describe";

    final CompletableFuture<byte[]> answer = new CompletableFuture<>();

    DescribeJob(String modelName, String version) {
        super(modelName, version, WorkerCommands.DESCRIBE, describeInput());
    }

    private static RequestInput describeInput() {
        RequestInput input = new RequestInput(UUID.randomUUID().toString());
        input.updateHeaders(DESCRIBE_HEADER, "True"); // as TorchServe's own ?customized=true does
        return input;
    }

    /** Queues the call for a worker of {@code model} and waits for its answer. */
    byte[] call(Model model) throws Exception {
        if (!ModelManager.getInstance().addJob(this)) {
            throw new ServiceUnavailableException(Guard.label(model) + " has no worker to take the call");
        }
        try {
            return answer.get(model.getResponseTimeout(), TimeUnit.SECONDS);
        } catch (TimeoutException e) {
            throw new RequestTimeoutException("no worker of " + Guard.label(model) + " answered");
        } catch (ExecutionException e) {
            throw new ServiceUnavailableException(e.getCause().getMessage());
        }
    }

    @Override
    public void response(
            byte[] body,
            CharSequence contentType,
            int statusCode,
            String statusPhrase,
            Map<String, String> responseHeaders) {
        if (statusCode == 200) {
            answer.complete(body);
        } else {
            answer.completeExceptionally(
                    new IllegalStateException("the worker answered the describe call with " + statusCode));
        }
    }

    @Override
    public void sendError(int status, String error) {
        answer.completeExceptionally(new IllegalStateException(error));
    }

    @Override
    public boolean isOpen() {
        return true;
    }
}
