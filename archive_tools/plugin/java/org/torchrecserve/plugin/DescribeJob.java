package org.torchrecserve.plugin;

import java.util.Map;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.messages.RequestInput;
import org.pytorch.serve.util.messages.WorkerCommands;

/**
 * A describe call to whichever worker of a model takes it first, answered into a future: the
 * worker's description (our handler answers with its pid, artifact, load time, ...).
 *
 * <p>Also the way to wake a worker that waits idle for work: it takes the describe, answers, and
 * comes back to its loop, where it sees that it was asked to stop (see {@link Drain}).
 */
final class DescribeJob extends Job {
    final CompletableFuture<byte[]> answer = new CompletableFuture<>();

    DescribeJob(String modelName, String version) {
        super(modelName, version, WorkerCommands.DESCRIBE, describeInput());
    }

    private static RequestInput describeInput() {
        RequestInput input = new RequestInput(UUID.randomUUID().toString());
        input.updateHeaders("describe", "True"); // as TorchServe's own ?customized=true does
        return input;
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
